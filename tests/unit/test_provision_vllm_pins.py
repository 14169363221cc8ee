"""lab/provision_vllm.py, the vLLM version -> pins logic,
offline, on synthetic METADATA: the torch pin, the light packages' pins, the
per-version extras, the nearest-CPU-torch choice and the version knob."""

from __future__ import annotations

import pytest

from lab import provision
from lab import provision_vllm as pv

# Shaped like vLLM 0.33.0's METADATA (the lines that matter, plus noise).
META_033 = """Metadata-Version: 2.4
Name: vllm
Version: 0.33.0
Requires-Dist: regex
Requires-Dist: torch==2.14.0
Requires-Dist: torchvision==0.29.0
Requires-Dist: pillow>=13.0.0
Requires-Dist: llguidance<1.8.0,>=1.7.0; platform_machine == "x86_64" or platform_machine == "arm64"
Requires-Dist: xgrammar==0.2.8; platform_machine == "x86_64"
Requires-Dist: apache-tvm-ffi==0.1.11
Requires-Dist: tensorizer==2.10.1; extra == "tensorizer"
Requires-Dist: xgrammar==9.9.9; extra == "never"
"""
META_0271 = "Requires-Dist: torch==2.13.0\nRequires-Dist: llguidance<1.8.0,>=1.7.0\n"


def test_torch_pin_from_metadata():
    assert pv.torch_pin(META_033) == "2.14.0"
    assert pv.torch_pin(META_0271) == "2.13.0"
    assert pv.torch_pin(["numpy", "torch==2.13.0"]) == "2.13.0"  # pip report's requires_dist list


@pytest.mark.parametrize("meta", ["Requires-Dist: torch>=2.13\n", "Requires-Dist: numpy\n"])
def test_no_exact_torch_pin_is_an_error(meta):
    with pytest.raises(ValueError, match="no exact torch"):
        pv.torch_pin(meta)


def test_light_deps_take_the_metadata_pins_and_the_extras():
    deps = pv.light_deps(META_033, "0.33.0")
    assert "pillow>=13.0.0" in deps and "xgrammar==0.2.8" in deps  # from METADATA, not LIGHT_DEPS
    assert "llguidance<1.8.0,>=1.7.0" in deps and "apache-tvm-ffi==0.1.11" in deps
    assert "cbor2" in deps and "openai-harmony>=0.0.3" in deps  # not in METADATA: LIGHT_DEPS' spec
    assert deps[-1] == "partial-json-parser"  # EXTRA_DEPS["0.33.0"]
    assert not any("9.9.9" in d for d in deps)  # an extra's requirement is not taken
    assert "partial-json-parser" not in pv.light_deps(META_0271, "0.27.1")


def test_choose_torch_records_the_fallback():
    same = pv.choose_torch("2.13.0", True)
    assert same["used"] == "2.13.0" and same["cpu_build_of_pin"] is True
    far = pv.choose_torch("2.14.0", False)
    assert far["used"] == provision.TORCH_VERSION == "2.13.0"
    assert far["cpu_build_of_pin"] is False and "no CPU build" in far["why"] and "2.14.0" in far["why"]


def test_is_cpu_torch_from_a_pip_report_item():
    cpu = {"metadata": {"version": "2.13.0+cpu", "requires_dist": []}}
    cuda = {"metadata": {"version": "2.14.0", "requires_dist": [
        "filelock", 'cuda-toolkit[cublas]==13.0.3; platform_system == "Linux"']}}
    plain = {"metadata": {"version": "2.14.0", "requires_dist": ["filelock", "sympy>=1.13.3"]}}
    assert pv.is_cpu_torch(cpu) and not pv.is_cpu_torch(cuda) and pv.is_cpu_torch(plain)


def test_version_knob_defaults_to_0271(monkeypatch, tmp_path):
    monkeypatch.setenv("LMCACHE_PATCHTOOL_CACHE", str(tmp_path))
    monkeypatch.delenv(pv.VLLM_ENV, raising=False)
    assert pv.vllm_version() == "0.27.1"
    # one layer per vLLM version, shared by the lmcache versions (each probed once)
    assert pv.layer_path("0.5.3").name == pv.layer_path("0.5.6").name == "vllm-0.27.1-layer"
    assert pv.probe_stamp(pv.layer_path("0.5.3"), "0.5.3").name == ".probed-lmcache-0.5.3"
    monkeypatch.setenv(pv.VLLM_ENV, "0.28.0")
    assert pv.vllm_version() == "0.28.0" and pv.vllm_version("0.33.0") == "0.33.0"
    assert pv.layer_path("0.5.6").name == "vllm-0.28.0-layer"
