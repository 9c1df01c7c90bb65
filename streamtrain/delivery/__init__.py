"""Stage 5, delivery: what the worker learns leaves it as a servable base plus a stream of deltas.

- ``deltas``: the delta wire format, shared by the worker that writes it and the server that reads it.
- ``artifact``: a snapshot turned into a base a plain CPU process loads (``streamtrain export``).
- ``publisher``: in the worker, the touched rows cut between steps and published every interval.
- ``serve``: ``streamtrain serve``, a scoring server that follows the newest base and its deltas.
"""
