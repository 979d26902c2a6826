"""M2 (memory) and L2 (latency): fitted on fingerprints, extrapolated to the full depth.

**M2.** Per bit-width and per memory figure (``weight_bytes``, ``kv_bytes``,
``activation_peak_bytes``, ``rss_hwm_bytes``; see ``measure``), one scheduler process of TP size
``t`` holding ``n`` decoder layers is modelled as

    m = fixed[t] + n * per_layer[t]                      (PP 1, and every PP stage ...)
        + first_delta / t   on the first stage of a pipeline (PP > 1)
        + last_delta / t    on the last stage
        + (first_delta + last_delta - E) / t   on a middle stage

``fixed`` holds what one process has besides its layers (Python, torch, SGLang, the embedding,
the LM head, the logits), ``per_layer`` the weights, KV pool share and transients of a layer
(the activation peak has none: it is one layer's at any depth), and the deltas the pipeline
overhead of a stage: what a first stage lacks (LM head, final norm, logits) and what a last
stage lacks or adds (the embedding; its own LM head copy when the embedding is tied). A middle stage has neither end's tensors: both deltas, less the embedding
``E`` counted in both (its bytes are exact from the shapes, ``splitquant.model``; zero for the
KV and activation figures, which hold no embedding). They are solved by least squares from the
fingerprints: TP1/PP1 at 1 and 2 layers (fixed[1], per_layer[1]), TP1/PP2 at 2 and 3 layers
(stages of 1 + 1 and 1 + 2 layers: both deltas, and a check of per_layer[1] on a stage), TP t/PP1
at 1 and 2 layers (fixed[t], per_layer[t]). A 1-layer fingerprint cannot run PP 2 (each stage
needs a layer), so the pipeline runs use the 2-layer fingerprint and a 3-layer one (which L2
needs, below). Under TP x PP (plain SGLang at 16 bits; no fingerprint runs it) the deltas
are divided by ``t``: the embedding and LM head are vocab-parallel, sharded over the TP ranks.

**L2** (the paper's equations). Per bit-width and TP size, each fingerprint is timed at two
output lengths; ``E2E(n) = TTFT + (n - 1) * TPOT`` gives TTFT and TPOT. Both are then linear in
the depth ``L`` (a fixed cost: embedding, LM head, sampling, scheduling, HTTP; plus a per-layer
cost) and in the batch ``B`` (the batch sizes timed):

    T(L, B) = f0 + f1 B + L (g0 + g1 B)

fitted (non-negative least squares) on the PP 1 fingerprints (1 and 2 layers). A pipeline changes the per-layer cost, not
only adds a hop: here a PP 1 rank runs two threads and a PP 2 stage one (serve.sh gives each
rank its cores), so a layer takes about twice as long under PP. So PP gets its own line,
fitted on TP1/PP2 fingerprints of 2 and 3 layers (a 1-layer model has no second stage; the
3-layer one splits 1 + 2), and a pipeline of ``p > 2`` stages adds ``p - 2`` hops to it, a hop
being what PP 2's fixed cost exceeds PP 1's. Under TP x PP (16 bits, plain SGLang; no
fingerprint runs it) the TP 1 hop is added to the TP t/PP 1 line, ``p - 1`` times: an
assumption this profile does not check.

**Shared layouts** (``profile --layouts-at 16``): only one bit-width's fingerprints run TP t and
PP 2; the others run TP1/PP1 alone (10 fingerprint servers instead of 18) and take what a
layout adds from it: memory additively (``_borrow_layouts``; exact for weights and KV), latency
as a factor (``BorrowedLatencyFit``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from sglang_morph.iserve.space import Configuration, stage_layers

MEMORY_FIGURES = ("weight_bytes", "kv_bytes", "activation_peak_bytes", "rss_hwm_bytes")
# Figures with no per-layer term: a layer's activations are freed once the next layer has read
# them, so the serving peak is one layer's, whatever the depth. Extrapolating the fingerprints'
# noise (a few MB of allocator reuse) linearly to 30 layers estimated 76 MB for a measured 8.
_DEPTH_FREE = ("activation_peak_bytes",)
# Figures that hold the embedding (a middle pipeline stage does not).
_HOLDS_EMBEDDING = ("weight_bytes", "rss_hwm_bytes")
PHASES = ("ttft", "tpot")


def lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if x.shape[0] < x.shape[1] or np.linalg.matrix_rank(x) < x.shape[1]:
        raise ValueError(f"{x.shape[0]} measurements cannot determine {x.shape[1]} unknowns "
                         f"(rank {np.linalg.matrix_rank(x)})")
    return np.linalg.lstsq(x, y, rcond=None)[0]


# ---- M2 -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProcessMemory:
    """One scheduler process of a measured server: its position and one memory figure."""

    tp: int
    pp: int
    stage: int
    layers: int  # decoder layers this process holds
    value_bytes: float


@dataclasses.dataclass(frozen=True)
class MemoryFit:
    """Invariant: ``fixed_bytes`` and ``per_layer_bytes`` have the same TP sizes."""

    figure: str
    fixed_bytes: dict[int, float]
    per_layer_bytes: dict[int, float]
    first_delta_bytes: float
    last_delta_bytes: float
    embedding_bytes: int

    def check_integrity(self) -> None:
        if set(self.fixed_bytes) != set(self.per_layer_bytes) or 1 not in self.fixed_bytes:
            raise ValueError(f"{self.figure}: needs TP 1 and the same TP sizes in both terms")

    def process_bytes(self, tp: int, pp: int, stage: int, layers: int) -> float:
        if tp not in self.fixed_bytes:
            raise ValueError(f"{self.figure}: no fingerprint measured TP {tp}")
        m = self.fixed_bytes[tp] + layers * self.per_layer_bytes[tp]
        if pp > 1:
            first, last = stage == 0, stage == pp - 1
            e = self.embedding_bytes if self.figure in _HOLDS_EMBEDDING else 0
            delta = (self.first_delta_bytes if first else self.last_delta_bytes if last
                     else self.first_delta_bytes + self.last_delta_bytes - e)
            m += delta / tp
        # (a middle stage's activation peak sums two noisy deltas of a few MB and came out
        # negative: no figure is)
        return max(m, 0.0)


def fit_memory(figure: str, points: Sequence[ProcessMemory], embedding_bytes: int) -> MemoryFit:
    tps = sorted({p.tp for p in points if p.pp == 1})
    has_pp = any(p.pp > 1 for p in points)
    columns = [("fixed", t) for t in tps]
    columns += [] if figure in _DEPTH_FREE else [("layer", t) for t in tps]
    columns += [("first", 0), ("last", 0)] if has_pp else []
    x = np.zeros((len(points), len(columns)))
    for i, p in enumerate(points):
        if p.pp > 1 and p.tp != 1:
            raise ValueError("pipeline fingerprints are TP 1")
        x[i, columns.index(("fixed", p.tp))] = 1
        if ("layer", p.tp) in columns:
            x[i, columns.index(("layer", p.tp))] = p.layers
        if p.pp > 1:
            if p.stage == 0:
                x[i, columns.index(("first", 0))] = 1
            elif p.stage == p.pp - 1:
                x[i, columns.index(("last", 0))] = 1
            else:
                raise ValueError("pipeline fingerprints have no middle stage")
    solution = lstsq(x, np.array([p.value_bytes for p in points], dtype=np.float64))
    value = dict(zip(columns, solution.tolist()))
    fit = MemoryFit(figure, {t: value[("fixed", t)] for t in tps},
                    {t: value.get(("layer", t), 0.0) for t in tps},
                    value.get(("first", 0), 0.0), value.get(("last", 0), 0.0), embedding_bytes)
    fit.check_integrity()
    return fit


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per figure: ``total`` over all processes and ``peak`` of the largest one."""

    total_bytes: dict[str, float]
    peak_bytes: dict[str, float]

    @property
    def accounted_total_bytes(self) -> float:
        return sum(self.total_bytes[f] for f in MEMORY_FIGURES if f != "rss_hwm_bytes")

    @property
    def accounted_peak_bytes(self) -> float:
        return self.peak_bytes["accounted_bytes"]


def estimate_memory(fits: dict[str, MemoryFit], cfg: Configuration,
                    num_layers: int) -> MemoryEstimate:
    """Every process of ``cfg`` on the full model (SGLang's default stage split)."""
    totals: dict[str, float] = {}
    peaks: dict[str, float] = {}
    accounted = []
    for stage, n in enumerate(stage_layers(num_layers, cfg.pp)):
        per = {f: fits[f].process_bytes(cfg.tp, cfg.pp, stage, n) for f in fits}
        accounted.append(sum(v for f, v in per.items() if f != "rss_hwm_bytes"))
        for f, v in per.items():
            totals[f] = totals.get(f, 0.0) + v * cfg.tp
            peaks[f] = max(peaks.get(f, 0.0), v)
    peaks["accounted_bytes"] = max(accounted)
    return MemoryEstimate(totals, peaks)


# ---- L2 -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LatencyPoint:
    """TTFT and TPOT of one server at one batch size (solved from two output lengths)."""

    tp: int
    pp: int
    layers: int
    batch: int
    ttft_s: float
    tpot_s: float


def ttft_tpot(e2e_by_length: dict[int, float]) -> tuple[float, float]:
    """``E2E(n) = TTFT + (n - 1) TPOT`` at two lengths -> (TTFT, TPOT)."""
    if len(e2e_by_length) != 2:
        raise ValueError(f"need two output lengths, got {sorted(e2e_by_length)}")
    (n1, e1), (n2, e2) = sorted(e2e_by_length.items())
    tpot = (e2 - e1) / (n2 - n1)
    return e1 - (n1 - 1) * tpot, tpot


_LATENCY_FEATURES = ("1", "B", "L", "L*B")


def _latency_row(layers: int, batch: int) -> np.ndarray:
    return np.array([1, batch, layers, layers * batch], np.float64)


def _fit_phase(points: Sequence[LatencyPoint], phase: str) -> tuple[float, ...]:
    """``f0, f1, g0, g1`` of ``T = f0 + f1 B + L (g0 + g1 B)``; with one batch size measured
    the ``B`` terms cannot be told apart and are 0."""
    from scipy.optimize import nnls

    keep = [0, 2] if len({p.batch for p in points}) == 1 else [0, 1, 2, 3]
    x = np.array([_latency_row(p.layers, p.batch)[keep] for p in points])
    y = np.array([p.ttft_s if phase == "ttft" else p.tpot_s for p in points])
    lstsq(x, y)  # refuses points that cannot determine the line
    # Non-negative, as splitquant/cost.py: no term may make a deeper model or a larger batch faster.
    # Noise on a shared CPU can make a 2-layer fingerprint time below its 1-layer one; an
    # unconstrained solve would then extrapolate that to 30 layers as a negative time.
    full = np.zeros(4)
    full[keep] = nnls(x, y)[0]
    return tuple(full.tolist())


@dataclasses.dataclass(frozen=True)
class LatencyFit:
    """One TP size's L2: per phase, ``f0, f1, g0, g1`` at PP 1 (``pp1``) and, fitted on the
    PP 2 fingerprints, at PP 2 (``pp2``; None when none was measured, then ``hop_from`` lends
    its hop). A pipeline of ``p > 2`` stages adds ``p - 2`` hops, a hop being what PP 2's fixed
    cost exceeds PP 1's (one stage boundary: a send, a receive, a process)."""

    tp: int
    pp1: dict[str, tuple[float, ...]]
    pp2: dict[str, tuple[float, ...]] | None = None
    hop_from: "LatencyFit | None" = None

    def hop_s(self, phase: str, batch: int) -> float:
        if self.pp2 is None:
            if self.hop_from is None:
                raise ValueError(f"TP {self.tp}: no pipeline fingerprint to estimate PP from")
            return self.hop_from.hop_s(phase, batch)
        pp2, pp1 = self.pp2[phase], self.pp1[phase]
        return (pp2[0] - pp1[0]) + (pp2[1] - pp1[1]) * batch

    def seconds(self, phase: str, layers: int, batch: int, pp: int) -> float:
        if pp == 1 or self.pp2 is None:
            base = float(_latency_row(layers, batch) @ np.asarray(self.pp1[phase]))
            return base + (pp - 1) * self.hop_s(phase, batch) if pp > 1 else base
        base = float(_latency_row(layers, batch) @ np.asarray(self.pp2[phase]))
        return base + (pp - 2) * self.hop_s(phase, batch)


@dataclasses.dataclass(frozen=True)
class BorrowedLatencyFit:
    """A bit-width whose fingerprints ran TP1/PP1 only (``profile --layouts-at``): a layout (TP
    ``tp``, PP ``p``) is taken to slow it by the factor it slows the reference bit-width, whose
    fingerprints ran every layout, at the same depth and batch:

        T_b(layout) = T_b(TP1/PP1) * T_ref(layout) / T_ref(TP1/PP1)

    A factor, not an added time: a pipeline stage here runs one thread where a PP 1 rank runs
    two, so a layer under PP costs more in proportion to what it costs at all. The data do not
    settle it: refitted on the profile of 275a433 without the W8/W4 layout fingerprints, the
    factor and an added time missed the W8/W4 configurations measured in full by about the
    same (all nine: TTFT 23% and 21% mean, TPOT 23% both). An assumption per bit-width, which
    ``benchmark/iserve/estimates.py --layouts-at`` checks against the configurations measured
    in full."""

    tp: int
    own: LatencyFit  # TP1/PP1 of this bit-width
    reference: dict[int, LatencyFit]  # the reference bit-width's fits, per TP size
    reference_bits: int

    def seconds(self, phase: str, layers: int, batch: int, pp: int) -> float:
        if self.tp == 1 and (pp == 1 or self.own.pp2 is not None):
            return self.own.seconds(phase, layers, batch, pp)  # measured at this bit-width
        own = self.own.seconds(phase, layers, batch, 1)
        if self.tp not in self.reference:
            raise ValueError(f"no fingerprint was profiled at TP {self.tp} (not at the "
                             f"reference {self.reference_bits} bits either)")
        base = self.reference[1].seconds(phase, layers, batch, 1)
        return own * self.reference[self.tp].seconds(phase, layers, batch, pp) / base


def fit_latency(points: Sequence[LatencyPoint], tp: int,
                hop_from: LatencyFit | None = None) -> LatencyFit:
    points = [p for p in points if p.tp == tp]
    pp1 = [p for p in points if p.pp == 1]
    pp2 = [p for p in points if p.pp == 2]
    if any(p.pp > 2 for p in points):
        raise ValueError("pipeline fingerprints are PP 2")
    try:
        pp2_fit = {phase: _fit_phase(pp2, phase) for phase in PHASES} if pp2 else None
    except ValueError:  # one PP depth only (a profile cut short): no pipeline estimate
        pp2_fit, hop_from = None, None
    return LatencyFit(tp, {phase: _fit_phase(pp1, phase) for phase in PHASES}, pp2_fit,
                      None if pp2_fit else hop_from)


# ---- from measurement records -------------------------------------------------------------


def process_points(records: Iterable[dict[str, Any]], bits: int, figure: str
                   ) -> list[ProcessMemory]:
    out = []
    for r in records:
        if r["bits"] != bits:
            continue
        split = stage_layers(r["num_layers"], r["pp"])
        for p in r["processes"]:
            if p.get(figure) is not None:
                out.append(ProcessMemory(r["tp"], r["pp"], p["pp_rank"], split[p["pp_rank"]],
                                         float(p[figure])))
    return out


def latency_points(records: Iterable[dict[str, Any]], bits: int) -> list[LatencyPoint]:
    """TTFT and TPOT per record and batch, each the fastest repetition's (see measure's
    docstring): streamed (``ttft_s``/``tpot_s``, at the longest output length) or solved from
    the end-to-end times at two lengths."""
    out = []
    for r in records:
        if r["bits"] != bits or not r["latency"]:
            continue
        by_batch: dict[int, dict[int, dict]] = {}
        for point in r["latency"]:
            by_batch.setdefault(point["batch"], {})[point["output_tokens"]] = point
        for batch, by_length in sorted(by_batch.items()):
            longest = by_length[max(by_length)]
            if "tpot_s" in longest:
                ttft, tpot = min(longest["ttft_s"]), min(longest["tpot_s"])
            else:
                ttft, tpot = ttft_tpot({n: min(p["e2e_s"]) for n, p in by_length.items()})
            out.append(LatencyPoint(r["tp"], r["pp"], r["num_layers"], batch, ttft, tpot))
    return out


@dataclasses.dataclass(frozen=True)
class ModelEstimates:
    """Everything fitted for one model: per bit-width, the memory fits per figure and the
    latency fits per TP size."""

    num_layers: int
    memory: dict[int, dict[str, MemoryFit]]
    latency: dict[int, dict[int, "LatencyFit | BorrowedLatencyFit"]]
    # bit-width -> why its fingerprints could not be fitted (an incomplete profile)
    unfitted: dict[int, str] = dataclasses.field(default_factory=dict)

    def memory_of(self, cfg: Configuration) -> MemoryEstimate:
        return estimate_memory(self.memory[cfg.bits], cfg, self.num_layers)

    def latency_of(self, cfg: Configuration, batch: int) -> tuple[float, float]:
        fit = self.latency[cfg.bits][cfg.tp]
        return (fit.seconds("ttft", self.num_layers, batch, cfg.pp),
                fit.seconds("tpot", self.num_layers, batch, cfg.pp))

    def covers(self, cfg: Configuration) -> str | None:
        """None, or why the fingerprints measured cannot estimate ``cfg``."""
        if cfg.bits in self.unfitted:
            return f"the {cfg.bits}-bit fingerprints cannot be fitted: {self.unfitted[cfg.bits]}"
        if cfg.bits not in self.memory or cfg.bits not in self.latency:
            return f"no fingerprint was profiled at {cfg.bits} bits"
        if cfg.tp not in self.latency[cfg.bits] or \
                cfg.tp not in self.memory[cfg.bits]["rss_hwm_bytes"].fixed_bytes:
            return f"no fingerprint was profiled at {cfg.bits} bits and TP {cfg.tp}"
        try:
            self.latency_of(cfg, 1)
        except ValueError as e:
            return str(e)
        return None


def fit_records(records: Sequence[dict[str, Any]], num_layers: int,
                embedding_bytes: int) -> ModelEstimates:
    """M2 and L2 from a profile's fingerprint records."""
    memory: dict[int, dict[str, MemoryFit]] = {}
    latency: dict[int, dict[int, LatencyFit]] = {}
    unfitted: dict[int, str] = {}
    all_bits = sorted({r["bits"] for r in records}, reverse=True)
    for bits in list(all_bits):
        memory[bits] = {}
        try:
            for figure in MEMORY_FIGURES:
                points = process_points(records, bits, figure)
                if points:
                    memory[bits][figure] = fit_memory(figure, points, embedding_bytes)
        except ValueError as e:  # an incomplete profile: the other bit-widths still serve
            unfitted[bits] = f"memory: {e}"
            del memory[bits]
            all_bits.remove(bits)
    for bits in all_bits:
        for figure, fit in memory[bits].items():
            if any(p.pp > 1 for p in process_points(records, bits, figure)):
                continue
            # No pipeline run reported this figure (profiles from before 16-bit PP ran with
            # --enable-morph have none: plain SGLang, without /morph/status). A stage boundary
            # moves the embedding and LM head, which no bit-width quantizes, so another
            # bit-width's deltas are this one's.
            donor = next((memory[b][figure] for b in all_bits if b != bits and figure in
                          memory[b] and any(p.pp > 1 for p in
                                            process_points(records, b, figure))), None)
            if donor is not None:
                memory[bits][figure] = dataclasses.replace(
                    fit, first_delta_bytes=donor.first_delta_bytes,
                    last_delta_bytes=donor.last_delta_bytes)
        points = latency_points(records, bits)
        tps = sorted({p.tp for p in points})
        latency[bits] = {}
        try:
            if 1 in tps:
                latency[bits][1] = fit_latency(points, 1)
            for tp in tps:
                if tp != 1:
                    latency[bits][tp] = fit_latency(points, tp, hop_from=latency[bits].get(1))
        except ValueError as e:
            unfitted[bits] = f"latency: {e}"
    _borrow_layouts(records, memory, latency, unfitted)
    return ModelEstimates(num_layers, memory, latency, unfitted)


def _layouts(records: Sequence[dict[str, Any]], bits: int) -> tuple[set[int], bool]:
    """TP sizes and whether PP 2 was fingerprinted at ``bits``."""
    mine = [r for r in records if r["bits"] == bits]
    return {r["tp"] for r in mine}, any(r["pp"] > 1 for r in mine)


def _borrow_layouts(records, memory, latency, unfitted) -> None:
    """Bit-widths fingerprinted at TP1/PP1 only (``profile --layouts-at``) take their TP t and
    PP terms from the reference bit-width that ran every layout (the widest; 16 bits first).

    Memory: what a layout adds (TP t's fixed and per-layer terms; the pipeline deltas, already
    borrowed above) is the reference's, plus this bit-width's own TP 1 difference from it:
    ``fixed[t] = ref.fixed[t] + (fixed[1] - ref.fixed[1])`` (a process's own overhead is not
    sharded) and ``per_layer[t] = ref.per_layer[t] + (per_layer[1] - ref.per_layer[1]) / t``
    (a layer's tensors are). Weights and KV come out exact (the embedding is not quantized and
    the KV is the same at every bit-width); the RSS terms are the assumption.
    Latency: ``BorrowedLatencyFit``."""
    fitted = [b for b in sorted(latency, reverse=True) if b not in unfitted and 1 in latency[b]]
    full_layouts = {b: _layouts(records, b) for b in fitted}
    reference = max(fitted, key=lambda b: (len(full_layouts[b][0]), full_layouts[b][1],
                                            b), default=None)
    if reference is None:
        return
    ref_tps, ref_pp = full_layouts[reference]
    for bits in fitted:
        tps, has_pp = full_layouts[bits]
        if bits == reference or (tps >= ref_tps and has_pp >= ref_pp):
            continue
        for figure, fit in list(memory[bits].items()):
            ref = memory[reference].get(figure)
            if ref is None:
                continue
            fixed, per_layer = dict(fit.fixed_bytes), dict(fit.per_layer_bytes)
            for t in ref.fixed_bytes:
                if t not in fixed:
                    fixed[t] = ref.fixed_bytes[t] + fit.fixed_bytes[1] - ref.fixed_bytes[1]
                    per_layer[t] = ref.per_layer_bytes[t] + (
                        fit.per_layer_bytes[1] - ref.per_layer_bytes[1]) / t
            memory[bits][figure] = dataclasses.replace(fit, fixed_bytes=fixed,
                                                       per_layer_bytes=per_layer)
        own = latency[bits]
        latency[bits] = {t: own[t] if t in own and (t != 1 or has_pp) else
                         BorrowedLatencyFit(t, own[1], latency[reference], reference)
                         for t in sorted(set(latency[reference]) | set(own))}
