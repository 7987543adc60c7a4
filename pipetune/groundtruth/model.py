"""The similarity model: when a profile counts as a known job, and what that job's best
config is.

How similarity is decided (lazily, at lookup; refitted only when the file's content
changed, so lookups on an unchanged store reuse one fit):

- **Features**: ``Profile.vector(CLUSTER_FEATURES)``.
- **Noise units**: each feature has a floor in :data:`SCALE_FLOORS`, the size of a
  difference that does not tell jobs apart (run-to-run jitter): 5 points of operator
  mix, a tenth of a core of CPU use, ~28% of speed, work or memory (0.25 in log units),
  half of a per-step count (relative to the larger of the two values compared, at least
  1: context switches and page faults per step are dominated by process warm-up and
  differ several-fold within one job, so each can add at most 2 units). A **distance**
  is the root-mean-square over features of the difference divided by the floor, so 1
  means "one floor per feature on average", whatever the number of features.
- **Clusters**: scikit-learn ``KMeans`` (``n_init=10``, ``random_state=0``) on the
  standardised features (``StandardScaler``: mean and population standard deviation over
  the records), each feature's scale floored at its noise floor so a feature that barely
  varies across a handful of records (or not at all) does not blow distances up. The
  number of clusters is the number of *distinct* profiles, capped at ``max_clusters``:
  walking the records in the order they were stored, a record is distinct when it is
  farther than ``min_bound`` from every distinct record before it, the distance under
  which a lookup calls a profile similar to a one-record cluster; so two records that
  would not be called similar to each other do not share a cluster (until the cap).
  Cluster ids are ordered by each cluster's oldest record, so they stay put as records
  are added.
- **Bound**: a profile is similar to its nearest cluster when its distance to the
  centroid is at most ``max(min_bound, bound_factor * radius)``, where ``radius`` is the
  RMS distance of the cluster's members to its centroid (the square root of the
  cluster's inertia per member: the paper derived its "new job" bound from the k-means
  inertia the same way). ``min_bound`` gives a one-record cluster, whose radius is 0, a
  non-zero reach. Similarity is measured in noise units rather than in standard
  deviations on purpose: the standard deviation over the store grows with every
  different job recorded, and a bound in those units would let a job halfway between
  two known ones count as similar to both.
- **Best config** for (cluster, bucket, objective): the records of that cluster with
  that batch-size bucket and objective, grouped by config; the config with the lowest
  median cost wins (ties: more records, then the older). ``support`` is the number of
  records (trials) that chose that config; ``cost`` its median.

Records are the store's dicts (see :mod:`pipetune.groundtruth.store`), already valid;
nothing here reads or writes a file.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any

from pipetune.errors import GroundTruthError
from pipetune.profiler.profile import CLUSTER_FEATURES, Profile
from pipetune.states import GroundTruthMatch
from pipetune.system.config import SystemConfig

_SHARE = (0.1, 0.0)
_LOG = (0.25, 0.0)
_COUNT = (1.0, 0.5)
#: Per feature, ``(absolute, relative)``: its noise floor at value ``v`` is
#: ``max(absolute, relative * |v|)``. See the module docstring for why.
SCALE_FLOORS: dict[str, tuple[float, float]] = {
    "op_conv_share": _SHARE,
    "op_matmul_share": _SHARE,
    "op_elementwise_share": _SHARE,
    "op_data_share": _SHARE,
    "op_other_share": _SHARE,
    "cpu_util": (0.1, 0.0),
    "log_samples_per_s": _LOG,
    "log_flops_proxy": _LOG,
    "ctx_switches_per_step": _COUNT,
    "page_faults_per_step": _COUNT,
    "log_peak_rss_mb": _LOG,
}
#: Floor for a feature missing from :data:`SCALE_FLOORS`.
DEFAULT_SCALE_FLOOR: tuple[float, float] = (0.1, 0.1)

_KMEANS_N_INIT = 10
_KMEANS_SEED = 0


@dataclass(frozen=True)
class GroundTruthEntry:
    """The best known config of one (cluster, batch-size bucket, objective)."""

    cluster: int
    bucket: int
    objective: str
    config: SystemConfig
    cost: float
    support: int
    #: Median one-time cost and speed-up over the default of the records behind
    #: ``config`` that carry them (None: none does).
    one_time: float | None = None
    speedup: float | None = None


@dataclass(frozen=True)
class Similarity:
    """The settings of the similarity rule (see the module docstring): at most
    ``max_clusters`` clusters, a cluster's reach ``max(min_bound, bound_factor *
    radius)``. Checked by the job spec's rule (:class:`~pipetune.spec.SimilaritySpec`); a
    bad value raises :class:`SpecError` naming it."""

    max_clusters: int = 8
    bound_factor: float = 2.0
    min_bound: float = 2.0

    def __post_init__(self) -> None:
        # The rule for these values is the job spec's (pipetune.similarity), not a copy.
        from pydantic import ValidationError

        from pipetune.spec import SimilaritySpec, spec_error_from_validation

        try:
            checked = SimilaritySpec(max_clusters=self.max_clusters,
                                     bound_factor=self.bound_factor, min_bound=self.min_bound)
        except ValidationError as e:
            raise spec_error_from_validation(e, SimilaritySpec, "pipetune.similarity") from None
        for name, value in checked.model_dump().items():
            object.__setattr__(self, name, value)

    def fit(self, records: list[dict[str, Any]], key: str) -> Fit:
        """Cluster ``records`` (not empty) and find each group's best config; ``key``
        names the version of the store they were read from."""
        import numpy as np

        names = CLUSTER_FEATURES
        x = np.array([[float(r["features"][n]) for n in names] for r in records])

        k = min(self.max_clusters, len(set(leaders(x, self.min_bound))))
        if k == 1:
            labels = np.zeros(len(x), dtype=int)
        else:
            from sklearn.cluster import KMeans

            mean = x.mean(axis=0)
            scale = np.maximum(x.std(axis=0), floors(names, mean))
            km = KMeans(n_clusters=k, n_init=_KMEANS_N_INIT, random_state=_KMEANS_SEED)
            labels = km.fit((x - mean) / scale).labels_
        # Renumber clusters by their oldest record so ids survive a refit.
        order = list(dict.fromkeys(int(label) for label in labels))
        labels = np.array([order.index(int(label)) for label in labels])

        centroids, sizes, radius, bounds = [], [], [], []
        for cid in range(len(order)):
            members = x[labels == cid]
            centroid = members.mean(axis=0)
            r = float(np.sqrt(np.mean(noise_distance(names, members, centroid) ** 2)))
            centroids.append(centroid)
            sizes.append(len(members))
            radius.append(r)
            bounds.append(max(self.min_bound, self.bound_factor * r))

        groups: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
        for rec, cid in zip(records, labels, strict=True):
            gkey = (int(cid), bucket(rec["batch_size"]), rec["objective"])
            groups.setdefault(gkey, []).append(rec)
        entries = {gkey: _best_entry(gkey, recs) for gkey, recs in groups.items()}
        return Fit(key, names, np.array(centroids), sizes, radius, bounds, entries)


@dataclass
class Fit:
    """Clusters fitted on one version of the records."""

    key: str
    names: tuple[str, ...]
    centroids: Any  # np.ndarray (k, d), feature units
    sizes: list[int]
    radius: list[float]
    bounds: list[float]
    entries: dict[tuple[int, int, str], GroundTruthEntry]

    def match(self, features: dict[str, float], bucket: int, objective: str) -> GroundTruthMatch:
        """The answer for a profile with these (finite) ``features``: its nearest
        cluster, whether it is within that cluster's bound, and the cluster's best config
        for ``bucket`` and ``objective`` if it knows one."""
        import numpy as np

        x = np.array([features[n] for n in self.names])
        dists = noise_distance(self.names, self.centroids, x)
        cluster = int(np.argmin(dists))
        distance = float(dists[cluster])
        bound = self.bounds[cluster]
        where = f"cluster {cluster} at distance {distance:.3g}"
        near = dict(cluster=cluster, bucket=bucket, distance=distance, bound=bound)
        if distance > bound:
            return GroundTruthMatch(
                hit=False,
                config=None,
                cost=None,
                support=0,
                **near,
                reason=f"new job: nearest is {where} > bound {bound:.3g}",
            )
        entry = self.entries.get((cluster, bucket, objective))
        if entry is None:
            return GroundTruthMatch(
                hit=False,
                config=None,
                cost=None,
                support=0,
                **near,
                reason=f"similar to {where} <= bound {bound:.3g}, but no config is known "
                f"there for batch bucket {bucket} and objective {objective}",
            )
        return GroundTruthMatch(
            hit=True,
            config=entry.config,
            cost=entry.cost,
            support=entry.support,
            one_time=entry.one_time,
            speedup=entry.speedup,
            **near,
            reason=f"similar to {where} <= bound {bound:.3g}; bucket {bucket}, {objective}: "
            f"{entry.config.label()} chosen by {entry.support} trial(s)",
        )

    def sorted_entries(self) -> list[GroundTruthEntry]:
        """Every (cluster, bucket, objective) with its best config, sorted by those keys."""
        return [self.entries[k] for k in sorted(self.entries)]

    def clusters(self) -> list[dict[str, Any]]:
        """The clusters, for display (see :meth:`GroundTruth.clusters`)."""
        out: list[dict[str, Any]] = []
        for cid in range(len(self.sizes)):
            centroid = self.centroids[cid]
            out.append(
                {
                    "id": cid,
                    "size": self.sizes[cid],
                    "radius": self.radius[cid],
                    "bound": self.bounds[cid],
                    "centroid": {n: float(v) for n, v in zip(self.names, centroid, strict=True)},
                    "entries": [
                        {
                            "bucket": e.bucket,
                            "objective": e.objective,
                            "config": e.config.to_dict(),
                            "cost": e.cost,
                            "support": e.support,
                        }
                        for k, e in sorted(self.entries.items())
                        if k[0] == cid
                    ],
                }
            )
        return out


def bucket(batch_size: int) -> int:
    """The power-of-two bucket of a batch size: the largest power of two <= it."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise GroundTruthError(f"batch size must be an integer >= 1, got {batch_size!r}")
    return 1 << (batch_size.bit_length() - 1)


def profile_features(profile: Profile) -> dict[str, float]:
    """The features the ground truth clusters on, by name."""
    try:
        vector = profile.vector(CLUSTER_FEATURES)
    except KeyError as err:
        raise GroundTruthError(f"cannot use this profile: {err.args[0]}") from None
    return dict(zip(CLUSTER_FEATURES, vector, strict=True))


def leaders(x: Any, min_bound: float) -> list[int]:
    """Each row's distinct profile, as a row index: walking the rows in order, a row
    farther than ``min_bound`` from every distinct row before it is distinct (its
    own leader); any other row belongs to the nearest of those (the first of equals).

    Computed leader by leader: each new one's distances to every row after it, so a
    store of thousands of records of a few profiles costs a few array operations."""
    import numpy as np

    x = np.asarray(x, dtype=float)
    n = len(x)
    out = np.arange(n)
    nearest = np.full(n, np.inf)  # each row's distance to its nearest leader so far
    i = 0
    while i < n:
        far = np.flatnonzero(nearest[i:] > min_bound)
        if not len(far):
            break  # every row left belongs to a leader before it
        lead = i + int(far[0])
        out[lead] = lead
        if lead + 1 < n:
            dists = noise_distance(CLUSTER_FEATURES, x[lead + 1:], x[lead])
            closer = dists < nearest[lead + 1:]
            nearest[lead + 1:][closer] = dists[closer]
            out[lead + 1:][closer] = lead
        i = lead + 1
    return [int(v) for v in out]


def config_key(rec: dict[str, Any]) -> str:
    """A record's config, as a string equal for equal configs."""
    return json.dumps(rec["config"], sort_keys=True)


def best_config(recs: list[dict[str, Any]]) -> tuple[str, list[float]]:
    """The config (as :func:`config_key`) with the lowest median cost among ``recs``,
    ties to more records, then the older; and its costs."""
    by_config: dict[str, list[float]] = {}
    for rec in recs:
        by_config.setdefault(config_key(rec), []).append(float(rec["cost"]))
    # Insertion order is record order; min() keeps the first of equals: older wins ties.
    best = min(by_config, key=lambda c: (statistics.median(by_config[c]), -len(by_config[c])))
    return best, by_config[best]


def median_field(recs: list[dict[str, Any]], name: str) -> float | None:
    """The median of the optional number ``name`` over the ``recs`` that carry it."""
    values = [float(r[name]) for r in recs if r.get(name) is not None]
    return float(statistics.median(values)) if values else None


def _best_entry(gkey: tuple[int, int, str], recs: list[dict[str, Any]]) -> GroundTruthEntry:
    best, costs = best_config(recs)
    cluster, bucket_, objective = gkey
    behind = [r for r in recs if config_key(r) == best]
    return GroundTruthEntry(
        cluster=cluster,
        bucket=bucket_,
        objective=objective,
        config=SystemConfig.from_dict(json.loads(best)),
        cost=float(statistics.median(costs)),
        support=len(costs),
        one_time=median_field(behind, "one_time"),
        speedup=median_field(behind, "speedup"),
    )


def floors(names: tuple[str, ...], at: Any) -> Any:
    """Each feature's noise floor at the values ``at``."""
    import numpy as np

    pairs = [SCALE_FLOORS.get(n, DEFAULT_SCALE_FLOOR) for n in names]
    absolute = np.array([a for a, _ in pairs])
    relative = np.array([r for _, r in pairs])
    return np.maximum(absolute, relative * np.abs(at))


def noise_distance(names: tuple[str, ...], points: Any, other: Any) -> Any:
    """Root-mean-square over features of the difference in noise units, one per row.

    A relative floor is taken at the larger magnitude of the two values, so the distance
    is symmetric and one count feature adds at most ``1 / relative`` units however far
    apart its values are (a cold process's first epoch faults in pages a warm one does
    not, so such counts differ by orders of magnitude within one job).
    """
    import numpy as np

    points = np.atleast_2d(points)
    scale = floors(names, np.maximum(np.abs(points), np.abs(other)))
    return np.sqrt(np.mean(((points - other) / scale) ** 2, axis=1))
