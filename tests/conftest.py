"""Shared fixtures: no network, tiny random HF checkpoints, and the embedded model loaded once."""

import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"  # no test may reach the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ["TIKTOKEN_CACHE_DIR"] = tempfile.mkdtemp(
    prefix="tiktoken-"
)  # never fetch or reuse a cache
os.environ["LLM_AOT_CACHE"] = tempfile.mkdtemp(
    prefix="aot-"
)  # --compile aot's packages: compiled by the tests
os.environ["LLM_COMPILE"] = (
    "off"  # generate.py's default (auto) would build a package per model shape: eager unless asked
)
os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = (
    "1"  # each package checks its inputs against the shapes it was built for
)

import pytest
import torch
from helpers import hf_reference_embedded


@pytest.fixture(scope="session")
def embedded():
    """(model in float32, tokenizer) of the embedded default GGUF, dequantized (the float
    reference)."""
    from formats import weights
    from formats.tokenizer import load_tokenizer

    model, info = weights.load(None, dtype=torch.float32, dequantize=True)
    return model, load_tokenizer(info.source)


@pytest.fixture(scope="session")
def hf_embedded():
    """HF transformers' own model on the same GGUF, dequantized (about 20 s, so once)."""
    return hf_reference_embedded()


CAPABILITY = (
    f"CPU capability {torch.backends.cpu.get_cpu_capability()} "
    f"(ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'unset')})"
)


def pytest_report_header(config):
    return CAPABILITY  # results of the tests marked isa depend on it


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if terminalreporter.stats.get("failed"):
        terminalreporter.write_line(f"failures above ran under {CAPABILITY}")
