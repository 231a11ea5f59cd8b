"""The whole test suite as `make test` runs it, in the least wall time two cores allow:

    .venv/bin/python tests/run_suite.py          # (make test)

Plain `pytest tests` runs every test in one process, but not the isa reruns below.

The tests marked isa run again under each lower instruction set ATen can dispatch to
(tests/lower_capabilities.py: `default` and `avx2` on an AVX-512 or AMX machine, `default` on an
AVX2 one). Int4 once passed on AVX-512 and printed garbage on AVX2.

Most of the suite is compiling (Inductor, g++), importing and Python: one core's work each. So
two lanes run side by side, one torch thread apiece:
- lane A: the heaviest compiling files (LANE_A);
- lane B: every other file not in SERIAL, so a new test file runs there by default.
Each lane then reruns its files' isa tests under one lower instruction set, if there is one.

The files in SERIAL run afterwards, alone with both threads, and then their isa tests under each
lower set. Their tests:
- time something (a stream's pace, a deadline) and must not share the machine;
- or start processes of their own (tensor parallelism);
- or check what holds at any thread count (batch invariance).

On a CPU with AMX tiles (Sapphire Rapids and later Xeons), the tests marked isa and the
batch-invariance tests run once more with oneDNN kept to AVX-512 (`amx_off`), so a result proven
on one of the two kinds is checked on the other on the same machine. tests/README.md says which
CPU kinds each run covers.

Each lane's log is printed when it ends, with a progress line every minute before. The run exits
1 if anything failed, after everything has run. Timings: RESULTS.md, "The test suite's wall time".
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
LANE_A = ["test_aot.py", "test_quantize.py", "test_generate.py", "test_speculative.py"]
SERIAL = [
    "test_serve.py",
    "test_serve_clients.py",
    "test_serve_constrain.py",
    "test_serve_lifecycle.py",
    "test_serve_logprobs.py",
    "test_lm_eval.py",
    "test_tp.py",
    "test_tp_engine.py",
    "test_tokenizer.py",
    "test_weights.py",
    "test_weights_fuzz.py",
    "test_batch_invariant.py",
]


AMX_OFF = "AVX512_CORE_BF16"  # oneDNN's widest instruction set below AMX


def here(names) -> list:
    return [os.path.join(TESTS, n) for n in names]


def run(args, capability=None, isa_only=None, extra_env=None) -> int:
    """pytest on args; with a capability, only their tests marked isa, under it (isa_only says
    otherwise); extra_env: more variables for the run."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    env |= {"ATEN_CPU_CAPABILITY": capability} if capability else {}
    isa_only = bool(capability) if isa_only is None else isa_only
    code = subprocess.call(
        [sys.executable, "-m", "pytest", *args, *(["-m", "isa"] if isa_only else [])], env=env
    )
    if code == 5 and isa_only:  # none of these files has a test marked isa
        return 0
    return code if code >= 0 else 128 - code  # killed by a signal: still a failure


def has_amx() -> bool:
    """Whether the CPU has AMX tiles, which oneDNN's bf16 and int8 kernels use where they are."""
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return False


def amx_off() -> list:
    """On an AMX machine, the tests marked isa and the batch-invariance tests again with oneDNN
    kept to AVX-512 (as on a Xeon or EPYC without AMX): AMX's kernels once changed a row's bits
    with the batch where AVX-512's did not. Elsewhere nothing: there is no AMX to turn off."""
    if not has_amx():
        return []
    print(
        "== the tests marked isa and test_batch_invariant.py with AMX off "
        f"(ONEDNN_MAX_CPU_ISA={AMX_OFF}) ==",
        flush=True,
    )
    env = {"ONEDNN_MAX_CPU_ISA": AMX_OFF}
    return [
        run([TESTS], isa_only=True, extra_env=env),
        run(here(["test_batch_invariant.py"]), isa_only=False, extra_env=env),
    ]


def lane(args, capability, log) -> str:
    """A shell line: pytest on args, then (if capability) the isa tests among them under it,
    whatever the first gave; its output into log; its exit status nonzero if either failed."""
    py, quoted = shlex.quote(sys.executable), " ".join(map(shlex.quote, args))
    line = f"a=0; b=0; {py} -m pytest {quoted} || a=1"
    if capability:
        line += (
            f"; ATEN_CPU_CAPABILITY={shlex.quote(capability)} {py} -m pytest {quoted} -m isa; "
            "c=$?; [ $c -eq 0 ] || [ $c -eq 5 ] || b=1"
        )  # 5: none of them marked isa
    return f"({line}; exit $((a | b))) > {shlex.quote(log)} 2>&1"


def progress(log) -> str:
    with open(log, errors="replace") as f:
        done = re.findall(r"\[\s*(\d+)%\]", f.read())
    return f"{done[-1]}%" if done else "starting"


def lanes(lower) -> int:
    """Lanes A and B side by side (module docstring); returns their combined exit status."""
    caps = (lower + [None, None])[:2]
    args = {"A": here(LANE_A), "B": [TESTS, *("--ignore=" + f for f in here(LANE_A + SERIAL))]}
    logs, start = tempfile.mkdtemp(prefix="lanes-"), time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = {
        n: subprocess.Popen(["sh", "-c", lane(args[n], cap, os.path.join(logs, n))], env=env)
        for n, cap in zip("AB", caps)
    }
    report = start + 60
    while any(p.poll() is None for p in procs.values()):
        time.sleep(1)
        if time.perf_counter() > report:  # a line a minute: CI sees the run alive
            report += 60
            print(
                f"lanes, {time.perf_counter() - start:.0f} s: "
                + ", ".join(f"{n} {progress(os.path.join(logs, n))}" for n in procs),
                flush=True,
            )
    for n, cap in zip("AB", caps):
        print(
            f"== lane {n}"
            + (f", then its isa tests under ATEN_CPU_CAPABILITY={cap}" if cap else "")
            + " =="
        )
        with open(os.path.join(logs, n), errors="replace") as f:
            print(f.read(), flush=True)
    shutil.rmtree(logs, ignore_errors=True)
    print(f"== the lanes took {time.perf_counter() - start:.0f} s ==", flush=True)
    return int(any(p.returncode for p in procs.values()))


def main() -> int:
    lower = subprocess.run(
        [sys.executable, os.path.join(TESTS, "lower_capabilities.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    start = time.perf_counter()
    if (
        len(os.sched_getaffinity(0)) < 2 or len(lower) > 2
    ):  # one core (or more sets than lanes): in turn
        codes = [run([TESTS])] + [run([TESTS], cap) for cap in lower]
    else:
        codes = [lanes(lower), run(here(SERIAL))]
        codes += [run(here(SERIAL), cap) for cap in lower]
    codes += amx_off()
    failed = any(codes)
    print(
        "FAILED: see the runs above"
        if failed
        else f"the suite took {time.perf_counter() - start:.0f} s"
    )
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
