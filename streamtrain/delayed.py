"""Late labels (docs/delayed-labels.md): what the worker makes of a joiner's samples, whose positives
arrive after their impression was trained.

A joiner emits every impression at once with its labels as known then (``impression``), and a
``label`` sample when a positive arrives later, carrying the impression's features; the decoder
reads both (``decode.SampleColumns``), and masks a late label past its task's attribution window.
Trained as they come, the impressions that later turn positive are fake negatives: the model
learns b(x) = p(x) / (1 + p(x)) instead of p(x), and under-predicts. Per task, ``correction`` says
what is done about it:

- ``none``: nothing (the naive baseline);
- ``fnw``, fake negative weighting (Ktena et al., RecSys 2019): a sample's loss is weighted so that
  its expectation under the stream's biased distribution is the loss under the true one: positives
  by 1 + p, negatives by (1 - p)(1 + p), p the model's own prediction, not differentiated;
- ``fnc``, fake negative calibration (same paper): trained as ``none``, served as p = b / (1 - b),
  a transform of each of its logits (``served_logits``) that the exported program carries;
- ``es_dfm``, elapsed-time sampling (Yang et al., AAAI 2021): the importance weights 1 + f_dp for
  positives and (1 + f_dp) f_rn for negatives, where f_dp(x) = p(x) s is the probability that an
  impression is a delayed positive (positive, and its label not known when it was emitted) and
  f_rn = (1 - p) / (1 - p + f_dp) that a negative is a real one. s, the share of positives whose
  label arrives after their impression's emission, is estimated online (``LateShare``), taken as
  independent of the features. With s = 1 it is fnw; it differs where a joiner emits some
  positives on their impression (a positive known at once, or a joiner that waits a while).
- ``pu``, the positive-unlabeled loss (Ktena et al., RecSys 2019, after du Plessis et al.): an
  impression is trained as it comes, and its late positive takes back the fake negative it was
  trained as, log(1 - f(x)), beside its own log f(x): once every label has arrived the summed loss
  is the one the final labels give. Its gradient is a constant -1 in the logit, so it stays bounded.

A plain event (no kind) keeps its weight of 1 under every correction: its labels are final.
``LateShare`` is part of the training state (it is in every snapshot, by partition).
``MaturedQuality`` scores the predictions against final labels, once each impression's window has
closed: the quality the provisional, progressive figures cannot give.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from streamtrain import avro_program as ap
from streamtrain.config import TaskConfig
from streamtrain.decode import ClickBatch
from streamtrain.metrics import LateLabelMetrics, ProgressiveQuality

# The largest biased logit fnc turns into a probability: b < 1/2 (z < 0), since p = b / (1 - b) <= 1;
# at this bound the served probability is 1 - 1e-6.
FNC_MAX_LOGIT = math.log1p(-1e-6)


def fnc_logits(biased: torch.Tensor) -> torch.Tensor:
    """The logit of p = b / (1 - b) for the logit z of b: log(e^z / (1 - e^z)) = z - log(1 - e^z),
    z clamped below 0 (a model that predicts b >= 1/2 serves p = 1 - 1e-6)."""
    z = biased.clamp(max=FNC_MAX_LOGIT)
    return z - torch.log(-torch.expm1(z))


def served_logits(logits: torch.Tensor, calibrated: Sequence[bool]) -> torch.Tensor:
    """``logits`` ([B] for one task, [B, tasks] for several) as served: fnc's tasks (``calibrated``)
    through ``fnc_logits``, the others as they are. The training forward and the exported program
    both call it, so the progressive metrics and a server see the same probabilities."""
    if not any(calibrated):
        return logits
    columns = logits.reshape(logits.shape[0], len(calibrated))  # an empty batch's too
    served = [fnc_logits(columns[:, t]) if fnc else columns[:, t] for t, fnc in enumerate(calibrated)]
    return torch.stack(served, dim=1).reshape(logits.shape)


class Corrections(nn.Module):
    """The tasks' corrections: loss weights (``weights``) and the served output (``served``). Its
    masks are buffers, on the model's device, out of the state dict: a snapshot does not depend on
    the corrections."""

    def __init__(self, tasks: Sequence[TaskConfig], device: torch.device):
        super().__init__()
        self.calibrated = tuple(t.correction == "fnc" for t in tasks)
        weighted = [t.correction in ("fnw", "es_dfm") for t in tasks]
        self.register_buffer("weighted", torch.tensor(weighted, device=device), persistent=False)
        estimated = [t.correction == "es_dfm" for t in tasks]
        self.register_buffer("estimated", torch.tensor(estimated, device=device), persistent=False)
        retracting = [t.correction == "pu" for t in tasks]
        self.register_buffer("retracting", torch.tensor(retracting, device=device), persistent=False)
        self.any_weighted = any(weighted) or any(retracting)

    def weights(
        self, logits: torch.Tensor, kind: torch.Tensor, late_share: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positive weight, negative weight, retracted), each shaped as ``logits``: what a sample's
        positive and negative parts of the cross-entropy are multiplied by (1 for plain events and
        tasks weighted by neither fnw nor es_dfm; ``late_share`` [tasks] is es_dfm's s, None: 1), and
        how much of a negative a positive takes back (1 on a pu task's late label, else 0)."""
        z = logits.detach().reshape(logits.shape[0], len(self.calibrated))  # an empty batch's too
        p = torch.sigmoid(z)
        delayed_positive = p if late_share is None else p * torch.where(self.estimated, late_share, 1.0)
        positive = 1 + delayed_positive
        # p -> 1 with s -> 0: a 0/0 whose limit, and weight, is 0 (a constant, not torch.finfo: the
        # pipeline traces this with torch.fx)
        real_negative = (1 - p) / (1 - p + delayed_positive).clamp(min=1e-30)
        negative = positive * real_negative
        corrected = self.weighted & (kind != ap.PLAIN).unsqueeze(1)
        one = torch.ones_like(p)
        late = self.retracting & (kind == ap.LATE_LABEL).unsqueeze(1)
        return (
            torch.where(corrected, positive, one).reshape(logits.shape),
            torch.where(corrected, negative, one).reshape(logits.shape),
            late.to(p.dtype).reshape(logits.shape),
        )

    def served(self, logits: torch.Tensor) -> torch.Tensor:
        return served_logits(logits, self.calibrated)


class LateShare:
    """Per task, the share s of positives whose label arrives after their impression was emitted:
    late labels' positives within the window over those plus the positives impressions carried when
    emitted (add-one smoothed, so 1 until the stream says otherwise). es_dfm's f_dp is p s.

    Each rank counts its own partitions' samples: a count is kept per partition in every snapshot
    (``StreamState.positives``), so a rank restored at any world size resumes from its partitions'
    counts. A batch's s is the count before it (``attach``, as the pipeline takes it), so a replay
    after a restore weighs each batch as the first run did.

    Before a window's worth of the stream has passed, the late labels of the first impressions are
    still to come, and s is low; with the reference joiner (every label late) it stays 1."""

    def __init__(self, tasks: int):
        self.tasks = tasks
        self.counts = np.zeros((2, tasks), np.int64)  # known at emission, late; of the batches taken

    def restore(self, positives: dict[int, list[int]], partitions: Iterable[int]) -> None:
        """Start from a snapshot's counts of ``partitions`` (this rank's)."""
        self.counts = np.zeros((2, self.tasks), np.int64)
        for partition in partitions:
            if partition in positives:
                self.counts += np.asarray(positives[partition], np.int64).reshape(2, self.tasks)

    def share(self) -> np.ndarray:
        known, late = self.counts
        return (late + 1) / (late + known + 1)

    def attach(self, batch: ClickBatch) -> ClickBatch:
        """``batch`` with the share as it stands before it; its positives then count."""
        if batch.samples is None:
            return batch
        share = torch.from_numpy(self.share().astype(np.float32))
        for counts in batch.samples.positives.values():
            self.counts += counts
        return replace(batch, samples=replace(batch.samples, late_share=share))


@dataclass
class _Waiting:
    """One partition's samples waiting for their windows to close: chunks in arrival order, which is
    the order of their impressions' times (the joiner emits a partition's samples in time order)."""

    chunks: deque[dict[str, np.ndarray]] = field(default_factory=deque)
    size: int = 0

    def add(self, chunk: dict[str, np.ndarray]) -> None:
        if len(chunk["id"]):
            self.chunks.append(chunk)
            self.size += len(chunk["id"])

    def ids(self) -> np.ndarray:
        return np.concatenate([c["id"] for c in self.chunks]) if self.chunks else np.zeros(0, np.int64)

    def oldest(self) -> float:
        return float(self.chunks[0]["time"][0]) if self.chunks else math.inf

    def closed(self, newest_ms: int, window_ms: float) -> dict[str, np.ndarray]:
        """Takes out the samples whose window has closed (impression time + window at or before the
        partition's ``newest_ms``), from the oldest chunks until one has none."""
        taken: list[dict[str, np.ndarray]] = []
        while self.chunks:
            chunk = self.chunks[0]
            closed = chunk["time"] + window_ms <= newest_ms
            if not closed.any():
                break
            self.chunks.popleft()
            taken.append({k: v[closed] for k, v in chunk.items()})
            if not closed.all():
                self.chunks.appendleft({k: v[~closed] for k, v in chunk.items()})
            self.size -= int(closed.sum())
        if not taken:
            return {}
        return {k: np.concatenate([c[k] for c in taken]) for k in taken[0]}

    def drop_oldest(self, count: int) -> int:
        """Drops up to ``count`` of the oldest samples; how many."""
        chunk = self.chunks.popleft()
        dropped = min(count, len(chunk["id"]))
        if dropped < len(chunk["id"]):
            self.chunks.appendleft({k: v[dropped:] for k, v in chunk.items()})
        self.size -= dropped
        return dropped


def _drop_beyond(waiting: dict[int, _Waiting], bound: int) -> int:
    """Drops the oldest samples over all partitions past ``bound``; how many."""
    dropped, total = 0, sum(w.size for w in waiting.values())
    while total > bound:
        oldest = min(waiting.values(), key=_Waiting.oldest)
        gone = oldest.drop_oldest(total - bound)
        dropped, total = dropped + gone, total - gone
    return dropped


class MaturedQuality:
    """Per task, the progressive quality on matured labels: each impression's prediction, made before
    it trained, against its final label (its label at emission, or 1 if a late positive for the same
    impression id arrived within the window), once the window has closed; a plain event's at once.

    A window closes when the newest event time read from the impression's partition is past the
    impression's time plus the window: a partition read late (a backlog) holds its impressions open
    until its own late labels have been read. Samples wait per partition, where they arrive in time
    order and where an impression's late labels come (the key is its id). Memory is bounded: at most
    ``max_pending`` impressions and as many late positives wait per task, the oldest dropped past it
    (and counted); samples whose window closes leave at once. ``add`` (the training thread) only
    keeps the arrays; they are folded in when the figures are read (``compute``). A restart forgets
    what was waiting."""

    def __init__(self, tasks: Sequence[TaskConfig], window: int, max_pending: int, metrics: LateLabelMetrics):
        self.names = [t.name for t in tasks]
        self.windows_ms = [float(t.attribution_window_seconds or math.inf) * 1000 for t in tasks]
        self.quality = {name: ProgressiveQuality(window) for name in self.names}
        # task -> partition -> what waits there
        self.impressions: dict[str, dict[int, _Waiting]] = {name: {} for name in self.names}
        self.positives: dict[str, dict[int, _Waiting]] = {name: {} for name in self.names}
        self.newest_ms: dict[int, int] = {}  # per partition
        self.max_pending = max_pending
        self.metrics = metrics
        self._added: list[tuple[np.ndarray, ClickBatch]] = []
        self._lock = threading.Lock()

    def add(self, logits: np.ndarray, batch: ClickBatch) -> None:
        """The served logits given before ``batch`` trained ([B] or [B, tasks])."""
        if batch.size and batch.samples is not None:
            with self._lock:
                self._added.append((logits, batch))

    def waiting(self, task: str) -> int:
        """Impressions of ``task`` waiting for their window to close."""
        return sum(w.size for w in self.impressions[task].values())

    def compute(self) -> dict[str, dict[str, dict[str, float]]]:
        """task -> window -> figure, as ``ProgressiveQuality.compute`` gives them."""
        with self._lock:
            added, self._added = self._added, []
        for logits, batch in added:
            self._fold(logits.reshape(batch.size, len(self.names)), batch)
        for t, name in enumerate(self.names):
            self._mature(t, name)
            dropped = _drop_beyond(self.impressions[name], self.max_pending)
            dropped += _drop_beyond(self.positives[name], self.max_pending)
            if dropped:
                self.metrics.matured_dropped.labels(name).inc(dropped)
            self.metrics.matured_waiting.labels(name).set(self.waiting(name))
        return {name: quality.compute() for name, quality in self.quality.items()}

    def _fold(self, logits: np.ndarray, batch: ClickBatch) -> None:
        samples = batch.samples
        assert samples is not None
        labels = batch.labels.numpy().reshape(batch.size, len(self.names))
        kind = samples.kind.numpy()
        times = batch.event_time_ms.numpy()
        impression_time = times - samples.delay_ms.numpy()
        ids = samples.impression_id.numpy()
        plain, impression, late = kind == ap.PLAIN, kind == ap.IMPRESSION, kind == ap.LATE_LABEL
        for t, name in enumerate(self.names):
            if plain.any():  # final already
                self.quality[name].add(logits[plain, t], labels[plain, t])
        for partition in np.unique(samples.partition).tolist():
            here = samples.partition == partition
            self.newest_ms[partition] = max(self.newest_ms.get(partition, -(2**63)), int(times[here].max()))
            for t, name in enumerate(self.names):
                mine = here & impression & ~np.isnan(labels[:, t])
                self.impressions[name].setdefault(partition, _Waiting()).add(
                    {"id": ids[mine], "time": impression_time[mine], "logit": logits[mine, t], "label": labels[mine, t]}
                )
                arrived = here & late & (labels[:, t] == 1.0)
                self.positives[name].setdefault(partition, _Waiting()).add(
                    {"id": ids[arrived], "time": impression_time[arrived]}
                )

    def _mature(self, t: int, name: str) -> None:
        window = self.windows_ms[t]
        for partition, waiting in self.impressions[name].items():
            newest = self.newest_ms[partition]
            closed = waiting.closed(newest, window)
            positives = self.positives[name].get(partition)
            if closed:
                labels = closed["label"]
                if positives is not None and positives.size:
                    labels = np.where(np.isin(closed["id"], positives.ids()), 1.0, labels)
                self.quality[name].add(closed["logit"], labels)
            if positives is not None:  # their impressions matured by now, or never came
                positives.closed(newest, window)


class LateLabelWatch:
    """What the worker reports of late labels each step: late labels trained and past their window,
    their delays, each task's late share; and the matured quality (``matured``)."""

    def __init__(self, tasks: Sequence[TaskConfig], window: int, max_pending: int, metrics: LateLabelMetrics):
        self.names = [t.name for t in tasks]
        self.metrics = metrics
        self.matured = MaturedQuality(tasks, window, max_pending, metrics)

    def trained(self, batch: ClickBatch) -> None:
        samples = batch.samples
        if samples is None or not batch.size:
            return
        labels = batch.labels.numpy().reshape(batch.size, -1)
        late = samples.kind.numpy() == ap.LATE_LABEL
        delays = samples.delay_ms.numpy() / 1000.0
        for t, name in enumerate(self.names):
            arrived = late & (labels[:, t] == 1.0)
            if arrived.any():
                self.metrics.late_labels.labels(name, "trained").inc(int(arrived.sum()))
                self.metrics.delay_seconds.observe_many(delays[arrived], (name,))
            if samples.past_window[t]:
                self.metrics.late_labels.labels(name, "past_window").inc(int(samples.past_window[t]))
            if samples.late_share is not None:
                self.metrics.late_share.labels(name).set(float(samples.late_share[t]))
