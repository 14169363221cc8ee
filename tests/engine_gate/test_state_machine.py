"""The gate's state machine and its configuration plumbing (no processes)."""

from __future__ import annotations

import pytest

from gate import engine_servers as gs
import engine_gate_cli as engine_gate


def test_transition_tables():
    t = engine_gate.transitions(False)
    seq, s = [], "PREFLIGHT"
    while s != "DONE":
        seq.append(s)
        s = t[s]
    assert seq == engine_gate.MAIN_STATES + ["VERDICT"]
    assert t["ABORT"] == "VERDICT"
    t = engine_gate.transitions(True)
    assert t["RESTORE_DOWN"] == "CONTROL_STORE_UP" and t["CONTROL_RESTORE_DOWN"] == "VERDICT"
    # every state has a handler
    for state in engine_gate.MAIN_STATES + engine_gate.CONTROL_STATES + ["ABORT", "VERDICT"]:
        assert hasattr(engine_gate.GateRun, "s_" + state.lower()), state
    # stop states come before any restart: the engine is down before the restore arm starts
    order = engine_gate.MAIN_STATES
    assert order.index("STORE_DOWN") < order.index("RESTORE_UP")
    assert order.index("STORE_FLUSH") < order.index("STORE_DOWN")


def test_cli_config():
    ns = engine_gate.build_parser().parse_args(["--model", "/m", "--lengths", "8k,16k,1000", "--attention-backend",
                                            "auto", "--env", "A=1", "--gdn-prefill-backend", "none"])
    cfg = engine_gate.config_from_args(ns)
    assert cfg.lengths == [8192, 16384, 1000]
    assert cfg.attention_backend == "" and cfg.gdn_prefill_backend == ""  # "": not passed to vLLM
    assert cfg.env == {"A": "1"}
    cfg.apply_profile(engine_gate.ed.GPU)
    assert cfg.resolved_expect_k() == 1 and cfg.resolved_chunk() == 544
    cfg = engine_gate.GateConfig(model="/m")
    cfg.apply_profile(engine_gate.ed.GPU)
    assert cfg.resolved_expect_k() == 17
    # the CPU profile: no block of its own (PREFLIGHT asks the engine: it depends on the CPU), never
    # sub-paged, no GPU memory check, memory bounded
    cfg = engine_gate.GateConfig(model="/m")
    cfg.apply_profile(engine_gate.ed.CPU)
    assert (cfg.block_size, cfg.resolved_expect_k(), cfg.nvidia_smi) == (None, 1, "none")
    assert cfg.env["VLLM_CPU_KVCACHE_SPACE"] and cfg.transfer_mode == "auto" and not cfg.attention_backend
    assert cfg.env["VLLM_CPU_ATTN_SPLIT_KV"] == "0"  # the reduction order must not follow the threads
    with pytest.raises(SystemExit):
        engine_gate.config_from_args(engine_gate.build_parser().parse_args(["--model", "/m", "--env", "novalue"]))


def test_control_prefixes_from_venv(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "vllm").write_text("")
    run = engine_gate.GateRun(engine_gate.GateConfig(model="/m", control_venv=str(tmp_path)))
    assert run.control["vllm"] == [str(tmp_path / "bin" / "vllm"), "serve"]
    assert run.control["lmcache"] == ["lmcache", "server"]  # not in the venv: from PATH
    assert run.table["RESTORE_DOWN"] == "CONTROL_STORE_UP"


def test_vllm_and_lmcache_argv():
    kv = gs.kv_transfer_config("127.0.0.1", 5555)
    assert kv["kv_connector"] == "LMCacheMPConnector" and kv["kv_role"] == "kv_both"
    assert kv["kv_connector_module_path"] == "lmcache.integration.vllm.lmcache_mp_connector"
    assert kv["kv_connector_extra_config"] == {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5555}
    argv = gs.vllm_argv(["vllm", "serve"], gs.VllmSettings(model="/m", port=9), kv)
    assert argv[:3] == ["vllm", "serve", "/m"]
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "544"
    assert argv[argv.index("--attention-backend") + 1] == "FLASHINFER"
    assert "--kv-transfer-config" in argv and "--max-num-seqs" in argv
    assert "--kv-transfer-config" not in gs.vllm_argv(["vllm"], gs.VllmSettings(model="/m"), None)
    la = gs.lmcache_argv(["lmcache", "server"], gs.LMCacheSettings(l2_dir="/tmp/x", chunk_size=544))
    assert la[la.index("--l2-adapter") + 1] == '{"type":"fs","base_path":"/tmp/x"}'
    assert la[la.index("--eviction-policy") + 1] == "LRU" and "--l1-size-gb" in la
    with pytest.raises(ValueError):
        gs.lmcache_argv(["lmcache"], gs.LMCacheSettings())


def test_log_facts():
    text = ("\x1b[32mINFO\x1b[0m group 1: sub-paged, k=17 (tokens_per_block=544, slots_per_block=32): each "
            "logical block is 17 kernel pages, all of them are transferred [lmcache-patchtool hybrid-fa]\n"
            "INFO group 2: compressed (tokens_per_block=544, slots_per_block=32)\n")
    f = gs.lmcache_log_facts(text)
    assert f["sub_paged_groups"] == [{"group": 1, "k": 17, "tokens_per_block": 544, "slots_per_block": 32}]
    assert f["compressed_groups"] == [{"group": 2, "tokens_per_block": 544, "slots_per_block": 32}]
    # the pristine line without the marker is not mistaken for the fix
    assert gs.lmcache_log_facts("group 1: sub-paged, k=17 (tokens_per_block=544, slots_per_block=32)")[
        "sub_paged_groups"] == []
    v = gs.vllm_log_facts("Setting attention block size to 544 tokens to ensure ...\n"
                          "Using AttentionBackendEnum.FLASHINFER backend.\n"
                          "Using FLASH_ATTN attention backend out of potential backends: [...]")
    assert v["attention_block_size"] == 544 and v["attention_backends_logged"] == ["FLASHINFER", "FLASH_ATTN"]


def test_model_is_tiny(tmp_path):
    (tmp_path / "config.json").write_text('{"lmcache_patchtool_tiny": true}')
    assert engine_gate.model_is_tiny(str(tmp_path))
    assert not engine_gate.model_is_tiny(str(tmp_path / "nope"))
