"""The whole test suite as `make test` runs it, in the least wall time two cores allow:

    .venv/bin/python tests/run_suite.py          # (make test; plain `pytest tests` runs it all too)

Most of the suite is compiling (Inductor, g++), importing and Python, which take one core each.
So two lanes run side by side with one torch thread apiece:
- lane A: the heaviest compiling files (LANE_A);
- lane B: every other file not listed below, so a new test file runs here by default.
Each lane then runs the tests marked isa again, under one of the lower instruction sets ATen can
dispatch to (tests/lower_capabilities.py: default and avx2 on an AVX-512 or AMX machine). Int4
once passed on AVX-512 and printed garbage on AVX2.

The files in SERIAL run afterwards, alone with both threads:
- their tests time something (a stream's pace, a deadline) and must not share the machine;
- or they start processes of their own (tensor parallelism);
- or they check what holds at any thread count (batch invariance).
Timings are in RESULTS.md ("The test suite's wall time"). A failing lane prints its log and the
run exits 1, after every lane has finished.
"""
import os
import shlex
import subprocess
import sys
import tempfile
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
LANE_A = ["test_aot.py", "test_quantize.py", "test_generate.py", "test_speculative.py"]  # ~300 s here, B ~330
SERIAL = ["test_serve.py", "test_serve_clients.py", "test_serve_constrain.py", "test_serve_lifecycle.py",
          "test_serve_logprobs.py", "test_lm_eval.py", "test_tp.py", "test_tp_engine.py", "test_tokenizer.py",
          "test_weights.py", "test_weights_fuzz.py", "test_batch_invariant.py"]


def run(args, **env) -> int:
    return subprocess.call([sys.executable, "-m", "pytest", *args], env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


def lane(args, capability, log) -> str:
    """A shell line: pytest on args, then (if capability) the tests marked isa under it, whatever
    the first gave; its output into log, its exit status nonzero if either failed."""
    py = shlex.quote(sys.executable)
    line = f"{py} -m pytest {' '.join(map(shlex.quote, args))}; a=$?"
    if capability:
        line += f"; ATEN_CPU_CAPABILITY={capability} {py} -m pytest {shlex.quote(TESTS)} -m isa; b=$?"
    return f"({line}; exit $((a | ${{b:-0}}))) > {shlex.quote(log)} 2>&1"


def main() -> int:
    lower = subprocess.run([sys.executable, os.path.join(TESTS, "lower_capabilities.py")], capture_output=True,
                           text=True, check=True).stdout.split()
    if (os.cpu_count() or 1) < 2 or len(lower) > 2:  # one core (or more sets than lanes): one after another
        return max([run([TESTS])] + [run([TESTS, "-m", "isa"], ATEN_CPU_CAPABILITY=cap) for cap in lower])
    here = lambda names: [os.path.join(TESTS, n) for n in names]  # noqa: E731
    lanes = {"A": (here(LANE_A), (lower + [None])[0]),
             "B": ([TESTS, *("--ignore=" + f for f in here(LANE_A + SERIAL))], (lower + [None, None])[1])}
    logs, start = tempfile.mkdtemp(prefix="lanes-"), time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = {n: subprocess.Popen(["sh", "-c", lane(args, cap, os.path.join(logs, n))], env=env)
             for n, (args, cap) in lanes.items()}
    code = 0
    for n, p in procs.items():
        code |= p.wait()
        cap = lanes[n][1]
        print(f"== lane {n}" + (f", then the tests marked isa under ATEN_CPU_CAPABILITY={cap}" if cap else "") + " ==")
        with open(os.path.join(logs, n)) as f:
            print(f.read(), flush=True)
    print(f"== the lanes took {time.perf_counter() - start:.0f} s; now the serial files ==", flush=True)
    code |= run(here(SERIAL))
    print("FAILED: see the runs above" if code else f"the suite took {time.perf_counter() - start:.0f} s")
    return 1 if code else 0


if __name__ == "__main__":
    sys.exit(main())
