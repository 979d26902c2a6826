"""``sglang-morph``: start a server, run the offline tools, inspect and steer a running server.

    sglang-morph serve [launch_server flags]      # scripts/serve.sh: defaults + SGLang's server
    sglang-morph build-engines | profile-layers | plan | deploy | bench  [their arguments]
    sglang-morph status | swap | mode | top  [--url URL] [--api-key KEY] [--admin-api-key KEY]

Every problem with the arguments, the server's address or its answer is one line on stderr
(``sglang-morph <command>: error: ...``) and exit status 2; the offline tools keep their own
conventions (also exit 2 on bad input). Details: docs/operator.md.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any, Callable

import click

from sglang_morph.console.client import DEFAULT_URL, Client, CommandError, ServerError
from sglang_morph.morph.control.policy import MODES

# Wide enough for the examples in the help texts; click otherwise wraps at 80 columns.
HELP_WIDTH_COLUMNS = 100
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": HELP_WIDTH_COLUMNS}
PASS_THROUGH = {**CONTEXT, "ignore_unknown_options": True, "allow_extra_args": True}


class _Cli(click.Group):
    """click's group, except that every error is one line: click's usage errors (which it
    prints with the usage and a hint) and a command's CommandError alike."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True,
             **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            status = super().main(args, prog_name or "sglang-morph", complete_var, False,
                                  **extra)
        except click.ClickException as e:
            where = e.ctx.command_path if getattr(e, "ctx", None) else "sglang-morph"
            click.echo(f"{where}: error: {' '.join(e.format_message().split())}", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click.echo("sglang-morph: interrupted", err=True)
            sys.exit(130)
        sys.exit(status if isinstance(status, int) else 0)


@click.group("sglang-morph", cls=_Cli, context_settings=CONTEXT)
def main() -> None:
    """Operate sglang-morph: start a server, run the offline tools, watch and steer a running
    server.

    The server commands (status, swap, mode, top) take --url (default
    http://127.0.0.1:30000, or $SGLANG_MORPH_URL) and the server's keys (--api-key for the
    status routes, --admin-api-key for swap and mode; or $SGLANG_MORPH_API_KEY and
    $SGLANG_MORPH_ADMIN_API_KEY).
    """


# ---- serve and the offline tools: thin wrappers ----------------------------------------------


@main.command("serve", context_settings=PASS_THROUGH,
              short_help="Start SGLang with the plugin (scripts/serve.sh).")
@click.argument("launch_args", nargs=-1, type=click.UNPROCESSED)
def serve(launch_args: tuple[str, ...]) -> None:
    """Start SGLang with the plugin, as scripts/serve.sh does.

    Every argument goes to `python -m sglang.launch_server`; defaults are added only for
    flags not given: the embedded default model (--model-path), --host 127.0.0.1,
    --port 30000, and without an NVIDIA GPU the CPU engine (--device cpu, --attention-backend
    torch_native, --max-total-tokens 65536, --sleep-on-idle, a core list per rank). It first
    runs scripts/setup.sh, which does nothing when the environment is up to date.

    \b
    Examples:
      sglang-morph serve --dtype float32 --port 8000
      sglang-morph serve --enable-morph --morph-engines DIR --morph-memory-budget 400MB
    """
    from sglang_morph.server.process import SERVE_SH

    if not SERVE_SH.is_file():
        raise CommandError(f"{SERVE_SH} is missing: `serve` needs the repository checkout "
                           f"the package was installed from")
    # exec: the server is this process, so signals and the exit status are the server's own.
    os.execv("/bin/bash", ["bash", str(SERVE_SH), *launch_args])


def _delegate(name: str, target: str, summary: str) -> None:
    """``sglang-morph NAME ARGS...`` runs ``target``'s ``main(ARGS)`` (``module:function``):
    its options, help and exit status are the module's own."""

    def run(args: tuple[str, ...]) -> int:
        module_name, function = target.split(":")
        if "-h" in args or "--help" in args:
            click.echo(f"sglang-morph {name}: the same command as `python -m "
                       f"{module_name.removesuffix('.__main__')}`\n")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise CommandError(f"cannot import {module_name} ({e})") from None
        return getattr(module, function)(list(args))

    help_text = (f"{summary}\n\nRuns `python -m {target.split(':')[0].removesuffix('.__main__')}`"
                 f" with the arguments given; `sglang-morph {name} --help` shows its options.")
    command = click.Command(
        name, callback=run, help=help_text, short_help=summary, add_help_option=False,
        options_metavar="",
        context_settings=PASS_THROUGH,
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)])
    main.add_command(command)


_delegate("build-engines", "sglang_morph.morph.build_engines:main",
          "Build the W8/W4 variants of every decoder layer (MorphServe's layer engines).")
_delegate("profile-layers", "sglang_morph.morph.profile_layers:main",
          "Profile layer importance: the order in which layers are swapped.")
_delegate("plan", "sglang_morph.splitquant.__main__:main",
          "SplitQuant: per-layer bits and pipeline stages for a set of devices (offline).")
_delegate("deploy", "sglang_morph.iserve.__main__:main",
          "iServe: fingerprints, estimates and the deployment chosen for an intent (offline).")


@main.command("bench", context_settings=PASS_THROUGH, add_help_option=False, options_metavar="",
              short_help="The bursty-load replay benchmark (python -m benchmark.replay).")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> int:
    """The bursty-load replay benchmark (benchmark/replay), against servers it starts or
    --url URL.

    Runs `python -m benchmark.replay` with the arguments given (--quick, --sweep, --dp2,
    --url URL --label NAME, ...); `sglang-morph bench --help` shows its options.
    """
    import subprocess

    from sglang_morph.repo_data import REPO_ROOT

    if not (REPO_ROOT / "benchmark" / "replay" / "__main__.py").is_file():
        raise CommandError(f"the replay benchmark is not in {REPO_ROOT / 'benchmark'}: "
                           f"`bench` needs the repository checkout")
    if "-h" in args or "--help" in args:
        click.echo("sglang-morph bench: the same command as `python -m benchmark.replay`\n")
        sys.stdout.flush()  # before the child's help
    # A child process: the package never imports the benchmarks. benchmark/ sits beside the
    # package; the path makes it importable while paths in the arguments stay relative to
    # the caller's directory.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.call([sys.executable, "-m", "benchmark.replay", *args], env=env)


# ---- the server commands ----------------------------------------------------------------------


def server_options(function: Callable) -> Callable:
    """--url, --api-key and --admin-api-key."""
    function = click.option(
        "--admin-api-key", envvar="SGLANG_MORPH_ADMIN_API_KEY", metavar="KEY",
        help="the server's --admin-api-key, for swap and mode (without it they send "
             "--api-key)")(function)
    function = click.option(
        "--api-key", envvar="SGLANG_MORPH_API_KEY", metavar="KEY",
        help="the server's --api-key (sent as `Authorization: Bearer KEY`)")(function)
    return click.option(
        "--url", envvar="SGLANG_MORPH_URL", default=DEFAULT_URL, show_default=True,
        metavar="URL",
        help="the server's base address")(function)


def _client(url: str, api_key: str | None, admin_api_key: str | None) -> Client:
    return Client(url, api_key=api_key, admin_api_key=admin_api_key)


def _call(action: Callable[[], Any]) -> Any:
    """``action()``; a request that failed becomes the command's one-line error."""
    try:
        return action()
    except ServerError as e:
        raise CommandError(str(e)) from None


def _print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=1))


@main.command("status", context_settings=CONTEXT,
              short_help="Every mechanism's state, KV and transitions (JSON or a table).")
@server_options
@click.option("--json", "as_json", is_flag=True,
              help="print the answers as one JSON object: {\"elastic\": /elastic/status, "
                   "and each mechanism's status route by name}")
def status(url: str, api_key: str | None, admin_api_key: str | None, as_json: bool) -> None:
    """Show every elastic mechanism of a running server: state, KV, transitions.

    Reads GET /elastic/status and each enabled mechanism's own status route (/morph/status,
    /kunserve/status, /amoebas/status). A server without any mechanism answers 503, which is
    an error here.
    """
    from sglang_morph.console.view import MECHANISM_ROUTES, status_view

    client = _client(url, api_key, admin_api_key)
    elastic = _call(lambda: client.get("/elastic/status"))
    answers = {name: _call(lambda route=MECHANISM_ROUTES[name]: client.get(route))
               for name in elastic.get("mechanisms") or [] if name in MECHANISM_ROUTES}
    if as_json:
        _print_json({"elastic": elastic, **answers})
        return
    from rich.console import Console

    Console().print(status_view(elastic, answers))


def parse_layers(text: str) -> list[int]:
    """``17,14`` or ``0-7,12`` -> layer indices in the order given (ranges ascending)."""
    layers: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            if not dash:
                layers.append(int(first))
                continue
            lo, hi = int(first), int(last)
        except ValueError:
            raise click.BadParameter(f"{text!r}: expected layer indices like 17,14 or "
                                     f"0-7,12") from None
        if lo > hi:
            raise click.BadParameter(f"{text!r}: range {part.strip()} runs backwards")
        layers.extend(range(lo, hi + 1))
    if any(i < 0 for i in layers):
        raise click.BadParameter(f"{text!r}: layer indices are >= 0")
    return layers


def _layers_arg(ctx, param, value: str) -> list[int]:
    return parse_layers(value)


def _print_morph_outcome(answer: dict[str, Any], layers: list[int] | None,
                         replica: int | None) -> None:
    """One line per replica of a /morph answer: its mode, the named layers' precision (all
    quantized ones when none are named) and its KV."""
    from sglang_morph.console.view import (FULL_PRECISION_BITS, kv_line, precision_label,
                                           replica_list)

    statuses = replica_list(answer)
    # A swap or mode change of one replica answers with that replica's status only.
    chosen = [s for s in statuses if replica is None or s.get("replica") == replica]
    for s in chosen or statuses:
        bits = {layer["index"]: layer for layer in s.get("layers") or []}
        shown = layers if layers is not None else sorted(
            i for i, layer in bits.items() if layer["bits"] != FULL_PRECISION_BITS)
        precisions = " ".join(
            f"{i}:{precision_label(bits[i]['bits'])}{'*' if bits[i].get('pinned') else ''}"
            for i in shown if i in bits) or "every layer at full precision"
        click.echo(f"replica {s.get('replica', 0)}: mode {s.get('mode')} | {precisions} | KV "
                   f"{kv_line(s.get('kv_used_tokens'), s.get('kv_capacity_tokens'))}")


def _post_morph(client: Client, route: str, body: dict[str, Any], replica: int | None,
                as_json: bool, layers: list[int] | None) -> None:
    """POST a /morph control body (to one replica when given) and print the answer: as JSON,
    or one line per replica with ``layers``' precision (every quantized layer when None)."""
    if replica is not None:
        body["replica"] = replica
    answer = _call(lambda: client.post(route, body))
    if as_json:
        _print_json(answer)
    else:
        _print_morph_outcome(answer, layers, replica)


@main.command("swap", context_settings=CONTEXT,
              short_help="Move layers to another precision (POST /morph/swap).")
@click.argument("layers", metavar="LAYERS", callback=_layers_arg)
@click.argument("bits", type=click.IntRange(min=1))
@server_options
@click.option("--replica", type=click.IntRange(min=0),
              help="the data-parallel replica that swaps (required under --dp-size)")
@click.option("--pin/--no-pin", default=None,
              help="pin every layer named where it ends up / hand them back to the controller "
                   "(default: the layers that move stay pinned)")
@click.option("--json", "as_json", is_flag=True, help="print the server's answer as JSON")
def swap(layers: list[int], bits: int, url: str, api_key: str | None,
         admin_api_key: str | None, replica: int | None, pin: bool | None,
         as_json: bool) -> None:
    """Move LAYERS (e.g. 17,14 or 0-7) to BITS (8, 4; 16 restores) in one transition.

    POST /morph/swap. A swap down grows the KV cache into the freed weight memory; a restore
    first shrinks it (refused while live requests hold the tokens it must give back). Prints
    the layers' new precision (`*`: pinned) and the KV capacity.
    """
    body: dict[str, Any] = {"layers": layers, "bits": bits}
    if pin is not None:
        body["pin"] = pin
    _post_morph(_client(url, api_key, admin_api_key), "/morph/swap", body, replica, as_json,
                layers)


@main.command("mode", context_settings=CONTEXT,
              short_help="Set MorphServe's controller policy (POST /morph/mode).")
@click.argument("mode", type=click.Choice(sorted(MODES)), metavar="MODE")
@server_options
@click.option("--replica", type=click.IntRange(min=0),
              help="change one data-parallel replica's mode only (default: every replica's)")
@click.option("--json", "as_json", is_flag=True, help="print the server's answer as JSON")
def mode(mode: str, url: str, api_key: str | None, admin_api_key: str | None,
         replica: int | None, as_json: bool) -> None:
    """Set MorphServe's controller policy: accuracy, default or performance.

    POST /morph/mode. Takes effect at the controller's next decision; prints each replica's
    mode and its quantized layers.
    """
    _post_morph(_client(url, api_key, admin_api_key), "/morph/mode", {"mode": mode}, replica,
                as_json, None)


@main.command("top", context_settings=CONTEXT,
              short_help="Live view: layers, KV, queue, mechanisms, transitions.")
@server_options
@click.option("--interval-s", "--interval", "interval_s", type=click.FloatRange(min=0.1),
              default=1.0, show_default=True, metavar="SECONDS",
              help="time between two polls")
@click.option("--once", is_flag=True, help="print one frame and exit")
@click.option("--transitions", "transitions_shown", type=click.IntRange(min=0), default=8,
              show_default=True, help="recent transitions shown")
def top(url: str, api_key: str | None, admin_api_key: str | None, interval_s: float,
        once: bool, transitions_shown: int) -> None:
    """Live view of a running server, redrawn every --interval-s seconds (Ctrl-C quits).

    Shows the queue of each replica, each mechanism's state (MorphServe: every layer's
    precision, `*` pinned, KV capacity and use, the budget, per pipeline stage under
    --pp-size; KunServe: groups and layers held; AMOEBAs: units, heads and FFN rows) and
    the last transitions of every mechanism. Works for DP, TP and PP servers.
    """
    from sglang_morph.console import top as live

    client = _client(url, api_key, admin_api_key)
    _call(lambda: live.run(client, interval_s, once, transitions_shown=transitions_shown))


def help_pages(width_columns: int = HELP_WIDTH_COLUMNS) -> list[tuple[str, str]]:
    """``(command, its --help text)`` for ``sglang-morph`` and every subcommand, wrapped at
    ``width_columns`` whatever the terminal (the reference docs are generated from it). A
    wrapper's page is its own summary; its options are the wrapped module's."""
    width = {"terminal_width": width_columns, "max_content_width": width_columns}
    root = click.Context(main, info_name="sglang-morph", **{**main.context_settings, **width})
    pages = [("sglang-morph", main.get_help(root))]
    for name in main.list_commands(root):
        command = main.get_command(root, name)
        ctx = click.Context(command, info_name=name, parent=root,
                            **{**command.context_settings, **width})
        pages.append((f"sglang-morph {name}", command.get_help(ctx)))
    return pages


if __name__ == "__main__":
    main()
