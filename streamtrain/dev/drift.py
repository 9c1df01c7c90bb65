"""A drifting click stream: users and ads are born and retire at steady rates, and each carries an
effect of its own on the click, so the id space is open-ended and collisions cost AUC.

``streamtrain produce --drift`` writes it; ``streamtrain bench idspace`` trains it. Everything the
default stream plants (category, profile, slot, price, recent categories, purchases) is planted
here too, and the Bayes AUC is computed the same way, from the true probabilities.

Each kind of id (users, ads) is a population of ``size`` live ids. Ids are numbered by birth
(ordinals 0, 1, 2, ...); at event n the live ones are the ordinals [born(n), born(n) + size) with
born(n) = n * size // lifetime, so ``size / lifetime`` ids are born, and as many retire, per event,
and every id lives ``lifetime`` events. A retired id never comes back. Within the live window an
id is drawn with a popularity fixed at its birth (log-normal: a few hot ids, many seen a handful
of times). What an id is (a user's profile, an ad's category, campaign, advertiser, brand and
price, and its effect on the click logit) is drawn at birth, per block of ordinals from a
generator of its own, so it does not depend on how the events are chunked. Events carry the
ordinals scattered by a bijection over [0, 2**63): distinct, non-negative, and as arbitrary as
production ids.

A one-off tail (``Drift.one_off``, off by default) replaces that share of the events' users, and
independently that share of their ads, with ids seen in that event alone, as real click logs have
(about a third of the events). A one-off is an id like any other (a profile or an ad's
attributes, and an effect of its own on the click) that no model can learn, and that a mapping
admitting every id gives a row it will never read again. The one-offs are drawn from a generator of
their own, so the tail only replaces ids: the rest of each event is what it is without the tail.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from streamtrain.dev.produce import BRAND_MISSING_RATE, PROFILE_LEVELS, ClickStream

# The spread of log-popularity: the hottest 1% of live ids take about 13% of the traffic.
POPULARITY_SIGMA = 1.2
_BLOCK = 4096  # ordinals whose attributes are drawn together, from one generator
_MASK63 = np.uint64(2**63 - 1)
_USERS, _ADS = 0, 1  # the kinds' keys in the generators' seeds and their ids' salts
# Added to a kind's salt for its one-off ids: ordinals stay far below 2**61, so no one-off id is
# ever a live id.
_ONE_OFF_SALT = 1 << 61


@dataclass(frozen=True)
class Drift:
    """How the ids come and go (the ``--drift-*`` options of ``streamtrain produce``)."""

    users: int = 20_000  # live users at any moment
    ads: int = 10_000  # live ads at any moment
    lifetime: int = 200_000  # events an id stays live: size / lifetime of a kind are born per event
    # The standard deviation of each user's and each ad's own effect on the click logit: what a
    # model can learn only in that id's embedding row, and loses to a collision.
    id_effect: float = 1.0
    # The share of events whose user is seen in that event alone, and independently the share whose
    # ad is: the one-off tail.
    one_off: float = 0.0

    def __post_init__(self) -> None:
        for name in ("users", "ads", "lifetime"):
            if getattr(self, name) < 1:
                raise ValueError(f"drift {name} must be at least 1 (--drift-{name}), got {getattr(self, name)}")
        if not self.id_effect >= 0:
            raise ValueError(f"drift id_effect must be 0 or more (--drift-id-effect), got {self.id_effect}")
        if not 0 <= self.one_off < 1:
            raise ValueError(f"drift one_off must be in [0, 1) (--drift-one-off), got {self.one_off}")

    def distinct_ids(self, size: int, events: int) -> int:
        """How many ids of a population of ``size`` live in the first ``events`` events."""
        return size + (events - 1) * size // self.lifetime if events > 0 else 0


def scattered(ordinals: np.ndarray, salt: int) -> np.ndarray:
    """A bijection of [0, 2**63) (xorshifts, and multiplications by odd constants mod 2**63): distinct
    ordinals give distinct non-negative int64 ids with no visible order."""
    x = (ordinals.astype(np.uint64) + np.uint64(salt)) & _MASK63
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(31)
        x = (x * np.uint64(0xBF58476D1CE4E5B9)) & _MASK63
        x ^= x >> np.uint64(27)
        x = (x * np.uint64(0x94D049BB133111EB)) & _MASK63
        x ^= x >> np.uint64(31)
    return x.astype(np.int64)


class Population:
    """One kind's ids: who is live at each event, how popular each is, and what each is."""

    def __init__(
        self,
        size: int,
        lifetime: int,
        seed: list[int],
        attributes: Callable[[np.random.Generator, int], dict[str, np.ndarray]],
    ):
        self.size, self.lifetime, self.seed = size, lifetime, seed
        self.describe = attributes
        self.cumulative_popularity = np.zeros(1)  # [k]: the popularity of ordinals below k
        self.attributes: dict[str, np.ndarray] = {}

    def born(self, events: np.ndarray) -> np.ndarray:
        """The oldest live ordinal at each of these event indices."""
        return events.astype(np.int64) * self.size // self.lifetime

    def draw(self, rng: np.random.Generator, events: np.ndarray) -> np.ndarray:
        """One live ordinal per event index, by popularity."""
        oldest = self.born(events)
        self._describe_up_to(int(oldest.max()) + self.size)
        low = self.cumulative_popularity[oldest]
        high = self.cumulative_popularity[oldest + self.size]
        drawn = np.searchsorted(self.cumulative_popularity, low + rng.random(events.size) * (high - low), "right") - 1
        return np.clip(drawn, oldest, oldest + self.size - 1)

    def _describe_up_to(self, ordinals: int) -> None:
        while self.cumulative_popularity.size - 1 < ordinals:
            block = (self.cumulative_popularity.size - 1) // _BLOCK
            rng = np.random.default_rng([*self.seed, block])
            popularity = rng.lognormal(0.0, POPULARITY_SIGMA, _BLOCK)
            self.cumulative_popularity = np.concatenate(
                [self.cumulative_popularity, self.cumulative_popularity[-1] + np.cumsum(popularity)]
            )
            for name, values in self.describe(rng, _BLOCK).items():
                self.attributes[name] = np.concatenate([self.attributes[name], values]) if block else values


class DriftingClickStream(ClickStream):
    """The default stream's hidden model over populations of users and ads that drift (see the module
    docstring). Deterministic given (seed, start_time_ms, drift)."""

    def __init__(
        self,
        seed: int = 0,
        start_time_ms: int | None = None,
        events_per_second: float | None = None,
        drift: Drift | None = None,
    ):
        super().__init__(seed, start_time_ms, events_per_second)
        self.drift = drift = drift or Drift()

        def user(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
            return {
                "effect": rng.normal(0.0, drift.id_effect, n),
                **{name: rng.integers(low, high, n, dtype=np.int8) for name, (low, high) in PROFILE_LEVELS.items()},
            }

        def ad(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
            brand = self.zipf["brand"].draw(rng, n)
            return {
                "effect": rng.normal(0.0, drift.id_effect, n),
                "cate": self.zipf["cate_id"].draw(rng, n),
                "campaign": self.zipf["campaign_id"].draw(rng, n),
                "customer": self.zipf["customer"].draw(rng, n),
                "brand": np.where(rng.random(n) < BRAND_MISSING_RATE, -1, brand),
                "price": np.round(np.exp(rng.normal(4.0, 1.2, n)), 2).astype(np.float32),
            }

        self.users = Kind(Population(drift.users, drift.lifetime, [seed, 2, _USERS], user), _USERS)
        self.ads = Kind(Population(drift.ads, drift.lifetime, [seed, 2, _ADS], ad), _ADS << 62)
        if drift.one_off:
            self.tail_rng = np.random.default_rng([seed, 3])
            # A population of one live id that lives one draw: each of its ids is drawn once.
            self.users.one_offs = Population(1, 1, [seed, 3, _USERS], user)
            self.ads.one_offs = Population(1, 1, [seed, 3, _ADS], ad)

    def _draw_ids(self, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        events = self.emitted + np.arange(size)
        users = self.users.live.draw(self.rng, events)
        ads = self.ads.live.draw(self.rng, events)
        if self.drift.one_off:
            users = self.users.with_one_offs(self.tail_rng, users, self.drift.one_off)
            ads = self.ads.with_one_offs(self.tail_rng, ads, self.drift.one_off)
        return users, ads, self.users.ids(users), self.ads.ids(ads)

    def _ad_attributes(self, ads: np.ndarray) -> dict[str, np.ndarray]:
        return {name: self.ads.attribute(name, ads) for name in ("cate", "price", "campaign", "customer", "brand")}

    def _profiles(self, users: np.ndarray) -> dict[str, np.ndarray]:
        return {name: self.users.attribute(name, users) for name in PROFILE_LEVELS}

    def _id_effects(self, users: np.ndarray, ads: np.ndarray) -> np.ndarray | float:
        return self.users.attribute("effect", users) + self.ads.attribute("effect", ads)


class Kind:
    """One kind's ids as the events carry them: the live population's (ordinals 0, 1, ...) and, with a
    one-off tail, the one-offs (the k-th one-off as ordinal -1 - k)."""

    def __init__(self, live: Population, salt: int):
        self.live, self.salt = live, salt
        self.one_offs: Population | None = None
        self.drawn_one_offs = 0

    def with_one_offs(self, rng: np.random.Generator, ordinals: np.ndarray, share: float) -> np.ndarray:
        """``ordinals`` with ``share`` of them, drawn by ``rng``, replaced by new one-offs."""
        assert self.one_offs is not None
        tail = rng.random(ordinals.size) < share
        count = int(tail.sum())
        if count == 0:
            return ordinals
        drawn = self.one_offs.draw(rng, self.drawn_one_offs + np.arange(count))
        self.drawn_one_offs += count
        ordinals = ordinals.copy()
        ordinals[tail] = -1 - drawn
        return ordinals

    def ids(self, ordinals: np.ndarray) -> np.ndarray:
        live = ordinals >= 0
        one_off_ids = scattered(np.where(live, 0, -1 - ordinals), self.salt + _ONE_OFF_SALT)
        return np.where(live, scattered(np.where(live, ordinals, 0), self.salt), one_off_ids)

    def attribute(self, name: str, ordinals: np.ndarray) -> np.ndarray:
        live = ordinals >= 0
        values = self.live.attributes[name][np.where(live, ordinals, 0)]
        if not live.all():
            assert self.one_offs is not None
            values[~live] = self.one_offs.attributes[name][-1 - ordinals[~live]]
        return values
