"""What ``sglang-morph top`` and ``status`` show, as pure functions of the server's answers.

A ``Frame`` holds one poll: ``/elastic/status``, each enabled mechanism's own status route
(``/morph/status``, ``/kunserve/status``, ``/amoebas/status``), SGLang's ``/v1/loads`` and
the routes that failed. ``render(frame)`` turns it into a rich renderable; nothing here
talks to a server, so the tests feed it recorded answers.

Shapes handled (docs/reference/http-api.md): ``/morph/status`` is one status object, or
``{"replicas": [...]}`` under ``--dp-size``; under ``--pp-size`` it has every stage's layers
and a ``stages`` list; under ``--tp-size`` its figures are rank 0's and ``tensor_parallel``
says so. KunServe and AMOEBAs always answer ``{"replicas": [...]}``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Column, Table
from rich.text import Text

from sglang_morph.config import FULL_PRECISION_BITS
# Transitions shown at the bottom of the live view, newest last.
RECENT_TRANSITIONS = 8
# Colours by precision: full precision plain, W8 and W4 stand out more the fewer bits.
_BITS_STYLE = {FULL_PRECISION_BITS: "green", 8: "yellow", 4: "magenta"}
_OUTCOME_STYLE = {"applied": "green", "refused": "yellow", "failed": "red"}
# The routes a poll reads; a mechanism not listed here shows its /elastic/status state only.
MECHANISM_ROUTES = {"morph": "/morph/status", "kunserve": "/kunserve/status",
                    "amoebas": "/amoebas/status"}


@dataclasses.dataclass(frozen=True)
class Frame:
    """One poll of a server. ``elastic`` is ``/elastic/status`` (None when it failed or no
    mechanism is enabled), ``mechanisms`` each mechanism's own status answer by name,
    ``loads`` SGLang's ``/v1/loads`` (None when it failed), ``errors`` one line per failed
    route."""

    url: str
    time_unix_s: float
    elastic: dict[str, Any] | None = None
    mechanisms: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    loads: dict[str, Any] | None = None
    errors: dict[str, str] = dataclasses.field(default_factory=dict)


# ---- small formatters -------------------------------------------------------------------------


def precision_label(bits: int) -> str:
    """``FP`` for full precision (whatever the dtype), ``W8``/``W4`` for the variants."""
    return "FP" if bits == FULL_PRECISION_BITS else f"W{bits}"


def _tokens(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else "?"


def _mb(n_bytes: Any) -> str:
    return f"{n_bytes / 1e6:,.1f} MB" if isinstance(n_bytes, (int, float)) else "?"


def kv_line(used: Any, capacity: Any) -> str:
    """``used / capacity tokens (p%)``."""
    share = (f" ({100 * used / capacity:.0f}%)"
             if isinstance(used, int) and isinstance(capacity, int) and capacity > 0 else "")
    return f"{_tokens(used)} / {_tokens(capacity)} tokens{share}"


def replica_list(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-replica statuses of a mechanism's answer (one status object counts as one)."""
    replicas = answer.get("replicas")
    if isinstance(replicas, list):
        return [r for r in replicas if isinstance(r, dict)]
    return [answer]


def _clock(time_unix_s: Any) -> str:
    if not isinstance(time_unix_s, (int, float)):
        return "?"
    return time.strftime("%H:%M:%S", time.localtime(time_unix_s))


def _compact(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ---- morph ------------------------------------------------------------------------------------


def layers_text(layers: Iterable[dict[str, Any]]) -> Text:
    """``0:FP 1:FP ... 17:W4*``: every decoder layer's precision (``*``: pinned by the
    operator), coloured by bits; wraps to the terminal's width."""
    out = Text()
    for n, layer in enumerate(layers):
        if n:
            out.append(" ")
        bits = layer.get("bits")
        label = f"{layer.get('index', n)}:{precision_label(bits)}"
        out.append(label + ("*" if layer.get("pinned") else ""),
                   style=_BITS_STYLE.get(bits, "cyan"))
    return out


def _precision_counts(layers: list[dict[str, Any]]) -> str:
    counts: dict[int, int] = {}
    for layer in layers:
        counts[layer.get("bits")] = counts.get(layer.get("bits"), 0) + 1
    return ", ".join(f"{precision_label(b)} {n}" for b, n in
                     sorted(counts.items(), key=lambda item: -item[0]))


def morph_panel(status: dict[str, Any], title: str) -> Panel:
    """One replica's (or the pipeline's) ``/morph/status``."""
    if "error" in status and "layers" not in status:
        return Panel(Text(f"error: {status['error']}", style="red"), title=title)
    layers = status.get("layers") or []
    lines: list[RenderableType] = []
    controller = "on" if status.get("controller") else "off (manual only)"
    lines.append(Text(f"mode {status.get('mode', '?')} | controller {controller} | "
                      f"{status.get('quantized_layers', '?')} of {len(layers)} layers quantized "
                      f"({_precision_counts(layers)})"))
    kv = (f"KV {kv_line(status.get('kv_used_tokens'), status.get('kv_capacity_tokens'))} | "
          f"at start {_tokens(status.get('kv_capacity_tokens_at_start'))}")
    lines.append(Text(kv))
    lines.append(Text(f"budget {_mb(status.get('memory_budget_bytes'))}: weights "
                      f"{_mb(status.get('weight_bytes'))}, KV {_mb(status.get('kv_bytes'))}, "
                      f"free {_mb(status.get('free_budget_bytes'))}"))
    signals = status.get("signals")
    if isinstance(signals, dict):
        lines.append(Text(f"queue {signals.get('num_waiting_reqs', '?')} waiting, "
                          f"{signals.get('num_running_reqs', '?')} running | head waited "
                          f"{signals.get('head_wait_s', 0.0):.1f} s | KV use (EWMA) "
                          f"{100 * signals.get('kv_usage_ewma', 0.0):.0f}%"))
    tensor = status.get("tensor_parallel")
    if isinstance(tensor, dict):
        lines.append(Text(f"tensor parallel: {tensor.get('tp_size', '?')} ranks; figures are "
                          f"rank 0's (every rank holds the same)", style="dim"))
    for stage in status.get("stages") or []:
        first, last = stage.get("layer_range", ("?", "?"))
        lines.append(Text(f"stage {stage.get('stage', '?')} (layers {first}-{last}): KV "
                          f"{kv_line(stage.get('kv_used_tokens'), stage.get('kv_capacity_tokens'))}"
                          f" | weights {_mb(stage.get('weight_bytes'))}"))
    lines.append(layers_text(layers))
    return Panel(Group(*lines), title=title, title_align="left")


def _morph_renderables(answer: dict[str, Any]) -> list[RenderableType]:
    statuses = replica_list(answer)
    many = len(statuses) > 1 or "replicas" in answer
    out = []
    for n, status in enumerate(statuses):
        where = f" replica {status.get('replica', n)}" if many else ""
        if status.get("stages"):
            where += f" ({len(status['stages'])} pipeline stages)"
        out.append(morph_panel(status, f"morph{where}"))
    return out


# ---- KunServe and AMOEBAs -------------------------------------------------------------------


def kunserve_panel(answer: dict[str, Any]) -> Panel:
    groups = answer.get("groups")
    merged = any(len(g) > 1 for g in groups or [] if isinstance(g, list))
    table = Table("replica", "layers held", "KV", "peer mirror", "queue", "auto",
                  box=None, pad_edge=False)
    for n, r in enumerate(replica_list(answer)):
        start, stop = r.get("layers") or [None, None]  # [start, stop)
        load = r.get("load") if isinstance(r.get("load"), dict) else {}
        queue = load.get("waiting_reqs", "?")
        auto = r.get("auto") if isinstance(r.get("auto"), dict) else {}
        table.add_row(str(r.get("replica", n)),
                      (f"{start}-{stop - 1} of {r.get('num_layers', '?')}"
                       if isinstance(start, int) and isinstance(stop, int) else "?"),
                      kv_line(r.get("kv_used_tokens"), r.get("kv_capacity_tokens")),
                      _tokens(r.get("peer_kv_capacity_tokens")), str(queue),
                      auto.get("role", "on") if auto.get("enabled") else "off")
    head = Text(f"groups {groups} ({'merged: dropped layers, pipeline' if merged else 'apart'})")
    return Panel(Group(head, table), title="kunserve", title_align="left")


def amoebas_panel(answer: dict[str, Any]) -> Panel:
    table = Table("replica", "group", "KV heads", "FFN rows", "KV", "FFN released",
                  box=None, pad_edge=False)
    for n, r in enumerate(replica_list(answer)):
        heads, rows = r.get("kv_heads") or ["?", "?"], r.get("ffn_rows") or ["?", "?"]
        table.add_row(str(r.get("replica", n)), str(r.get("group", "?")),
                      f"{heads[0]}-{heads[1]}", f"{rows[0]}-{rows[1]}",
                      kv_line(r.get("kv_used_tokens"), r.get("kv_capacity_tokens")),
                      _mb(r.get("released_ffn_bytes")))
    head = Text(f"units {answer.get('units')}")
    return Panel(Group(head, table), title="amoebas", title_align="left")


def _state_panel(name: str, elastic: dict[str, Any]) -> Panel:
    """A mechanism without a status route of its own (or whose route failed): its
    ``/elastic/status`` state per replica."""
    lines = []
    for r in elastic.get("replicas") or []:
        state = (r.get("mechanisms") or {}).get(name, {}).get("state")
        if isinstance(state, dict):
            fields = " ".join(f"{k}={_compact(v, 40)}" for k, v in state.items())
            lines.append(Text(f"replica {r.get('replica', '?')}: {fields}"))
    return Panel(Group(*lines) if lines else Text("no state"), title=name, title_align="left")


# ---- queue, transitions, summary --------------------------------------------------------------


def queue_text(loads: dict[str, Any]) -> Text:
    """SGLang's own queue per data-parallel replica (``/v1/loads``)."""
    parts = []
    for load in loads.get("loads") or []:
        if isinstance(load, dict):
            parts.append(f"replica {load.get('dp_rank', '?')}: "
                         f"{load.get('num_waiting_reqs', '?')} waiting, "
                         f"{load.get('num_running_reqs', '?')} running")
    return Text("queue  " + (" | ".join(parts) if parts else "?"))


def transitions(elastic: dict[str, Any]) -> list[dict[str, Any]]:
    """Every replica's and mechanism's recent transitions, oldest first."""
    out = [t for r in elastic.get("replicas") or []
           for m in (r.get("mechanisms") or {}).values()
           for t in (m.get("transitions") or {}).get("recent") or [] if isinstance(t, dict)]
    return sorted(out, key=lambda t: t.get("time_unix_s") or 0.0)


def _what(t: dict[str, Any]) -> str:
    detail = t.get("detail") if isinstance(t.get("detail"), dict) else {}
    if t.get("mechanism") == "morph" and "layers" in detail:
        layers = ",".join(str(i) for i in detail["layers"])
        stage = f" (stage {detail['pp_stage']})" if "pp_stage" in detail else ""
        return f"layers {layers} -> {precision_label(detail.get('to_bits'))}{stage}"
    keep = {k: v for k, v in detail.items() if isinstance(v, (int, str, list)) and k != "source"}
    return _compact(" ".join(f"{k}={v}" for k, v in keep.items()), 50)


def transitions_table(elastic: dict[str, Any], limit: int = RECENT_TRANSITIONS) -> Table:
    totals: dict[str, int] = {}
    for r in elastic.get("replicas") or []:
        for m in (r.get("mechanisms") or {}).values():
            for outcome, n in ((m.get("transitions") or {}).get("totals") or {}).items():
                totals[outcome] = totals.get(outcome, 0) + int(n)
    title = "transitions " + (", ".join(f"{k} {v}" for k, v in totals.items()) or "none")
    table = Table(Column("time", no_wrap=True), Column("replica", no_wrap=True),
                  Column("transition", no_wrap=True), Column("what", min_width=16),
                  Column("KV tokens", no_wrap=True), Column("took", no_wrap=True),
                  Column("reason", no_wrap=True, overflow="ellipsis", ratio=1),
                  title=title, title_justify="left", box=None, pad_edge=False)
    for t in transitions(elastic)[-limit:]:
        outcome = str(t.get("outcome", "?"))
        # "morph swap" when applied; a refused or failed one says so (and is coloured).
        label = f"{t.get('mechanism', '?')} {t.get('action', '?')}"
        if outcome != "applied":
            label += f" {outcome}"
        duration = t.get("duration_s")
        table.add_row(_clock(t.get("time_unix_s")), str(t.get("replica", "?")),
                      Text(label, style=_OUTCOME_STYLE.get(outcome, "")), _what(t),
                      f"{_tokens(t.get('capacity_before_tokens'))} -> "
                      f"{_tokens(t.get('capacity_after_tokens'))}",
                      f"{duration:.2f} s" if isinstance(duration, (int, float)) else "?",
                      _compact(t.get("error") or t.get("reason") or "", 80))
    return table


def summary_table(elastic: dict[str, Any]) -> Table:
    """``sglang-morph status``: one row per replica and mechanism."""
    table = Table("replica", "mechanism", "state", "KV tokens", "transitions", box=None,
                  pad_edge=False)
    for r in elastic.get("replicas") or []:
        for name, m in sorted((r.get("mechanisms") or {}).items()):
            state = m.get("state") if isinstance(m.get("state"), dict) else {}
            used, capacity = state.get("kv_used_tokens"), state.get("kv_capacity_tokens")
            kv = kv_line(used, capacity).replace(" tokens", "")
            if name == "morph" and isinstance(state.get("layer_bits"), list):
                bits = state["layer_bits"]
                what = (f"{state.get('mode')}, {state.get('quantized_layers')}/{len(bits)} "
                        f"layers quantized")
            else:
                what = " ".join(f"{k}={_compact(v, 30)}" for k, v in state.items()
                                if not k.startswith("kv_"))
            totals = (m.get("transitions") or {}).get("totals") or {}
            table.add_row(str(r.get("replica", "?")), name, what, kv,
                          ", ".join(f"{v} {k}" for k, v in totals.items() if v) or "none")
    return table


def status_view(elastic: dict[str, Any], answers: dict[str, dict[str, Any]]) -> RenderableType:
    """``sglang-morph status``: the summary table, then every MorphServe replica's layers."""
    parts: list[RenderableType] = [summary_table(elastic)]
    for n, s in enumerate(replica_list(answers["morph"]) if "morph" in answers else []):
        parts.append(Text.assemble(f"replica {s.get('replica', n)} layers: ",
                                   layers_text(s.get("layers") or [])))
    return Group(*parts)


# ---- the whole frame --------------------------------------------------------------------------


def render(frame: Frame, transitions_shown: int = RECENT_TRANSITIONS) -> RenderableType:
    """The live view of one poll: header, queue, each mechanism, recent transitions, errors."""
    parts: list[RenderableType] = []
    names = list((frame.elastic or {}).get("mechanisms") or frame.mechanisms)
    parts.append(Text(f"sglang-morph top | {frame.url} | {_clock(frame.time_unix_s)} | "
                      f"mechanisms: {', '.join(names) or 'none'}", style="bold"))
    if frame.loads is not None:
        parts.append(queue_text(frame.loads))
    for name in names:
        answer = frame.mechanisms.get(name)
        if name == "morph" and answer is not None:
            parts.extend(_morph_renderables(answer))
        elif name == "kunserve" and answer is not None:
            parts.append(kunserve_panel(answer))
        elif name == "amoebas" and answer is not None:
            parts.append(amoebas_panel(answer))
        elif frame.elastic is not None:
            parts.append(_state_panel(name, frame.elastic))
    if frame.elastic is not None:
        parts.append(transitions_table(frame.elastic, transitions_shown))
    elif "/elastic/status" not in frame.errors:
        parts.append(Text("no elastic mechanism is enabled on this server", style="dim"))
    for route, message in frame.errors.items():
        parts.append(Text(f"{route}: {message}", style="red"))
    return Group(*parts)
