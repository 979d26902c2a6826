"""The plugin skeleton inside SGLang's own CLI parsing and plugin loader (no server needed)."""

from __future__ import annotations

import pickle

import pytest

from sglang_morph import SGLANG_VERSION
from sglang_morph.morph import config as morph_config
from sglang_morph.plugin import hooks
from sglang_morph.surface import Hook, PluginError, register_and_verify


@pytest.fixture(scope="module")
def loaded_sglang():
    """SGLang's real plugin loader, which finds us through the installed entry point."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    return prepare_server_args, HookRegistry


def test_installed_sglang_is_the_pinned_release():
    import importlib.metadata

    assert importlib.metadata.version("sglang") == SGLANG_VERSION


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("morph") == "sglang_morph.plugin:load"


def test_cli_hooks_applied_by_sglang_loader(loaded_sglang):
    _, registry = loaded_sglang
    for hook in hooks():
        if hook.only_if_imported is None:
            assert hook.target in registry._patched


def test_enable_morph_flag_parsed_and_carried_through_pickle(loaded_sglang, tmp_path):
    prepare_server_args, _ = loaded_sglang
    args = prepare_server_args(["--model-path", str(tmp_path), "--enable-morph"])
    assert morph_config.get(args) == morph_config.MorphConfig(enabled=True)
    # The scheduler process receives server_args by pickling (multiprocessing spawn).
    assert morph_config.get(pickle.loads(pickle.dumps(args))).enabled


def test_without_flag_morph_is_disabled(loaded_sglang, tmp_path):
    prepare_server_args, _ = loaded_sglang
    args = prepare_server_args(["--model-path", str(tmp_path)])
    assert morph_config.get(args) == morph_config.MorphConfig(enabled=False)


def test_unknown_morph_flag_is_a_cli_error(loaded_sglang, tmp_path, capsys):
    prepare_server_args, _ = loaded_sglang
    with pytest.raises(SystemExit) as exc:
        prepare_server_args(["--model-path", str(tmp_path), "--enable-morph-typo"])
    assert exc.value.code == 2
    assert "--enable-morph-typo" in capsys.readouterr().err


def test_hook_that_cannot_apply_stops_startup_naming_the_sglang_version(loaded_sglang):
    _, registry = loaded_sglang
    target = "sglang.srt.server_args.ServerArgs.no_such_method_in_this_release"
    try:
        with pytest.raises(PluginError) as exc:
            register_and_verify((Hook(target, lambda *a, **k: None, "AFTER"),))
        message = str(exc.value)
        assert target in message and f"sglang=={SGLANG_VERSION}" in message
        # A SystemExit, so SGLang's loader (which catches Exception) cannot swallow it.
        assert not isinstance(exc.value, Exception)
    finally:
        registry._hooks.pop(target, None)


def test_every_sglang_symbol_the_plugin_uses_exists_in_the_pinned_release(loaded_sglang):
    from sglang_morph import surface as sym

    assert sym.missing_symbols(sym.ALL_SYMBOLS) == []
    # Every hook target is in the list.
    listed = {s.path for s in sym.ALL_SYMBOLS if s.use == "hook"}
    from sglang_morph.morph.provenance import http_hooks

    # (registered from the launcher's CLI hook, not by plugin.hooks())
    http_side = {sym.HOOK_TOKENIZER_MANAGER_INIT, sym.HOOK_VALIDATE_REQUEST,
                 sym.HOOK_LAUNCH_SUBPROCESSES} | {target for target, _, _ in http_hooks()}
    assert {h.target for h in hooks()} | http_side == listed


def test_a_missing_symbol_stops_startup_with_one_line_naming_the_release(loaded_sglang):
    from sglang_morph import surface as sym

    gone = (sym.Symbol("sglang.srt.managers.scheduler.Scheduler.no_such_attribute", "read", True),
            sym.Symbol("sglang.srt.mem_cache.memory_pool.NoSuchPool", "read"),
            sym.Symbol("sglang.srt.no_such_module.thing", "call"),
            sym.Symbol("sglang.srt.managers.scheduler.Scheduler.pool_stats_observer", "read",
                       True))
    missing = sym.missing_symbols(gone)
    assert missing == [s.path for s in gone[:3]]
    message = sym.mismatch_message(missing)
    assert "\n" not in message and f"sglang=={SGLANG_VERSION}" in message
    assert all(path in message for path in missing)
