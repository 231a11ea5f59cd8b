"""Constraints tried first where a crash cannot take the server down: a child process compiles each
new constraint exactly as the engine will (constrain.compile_constraint, with the same tokenizer)
and walks its first PROBE_STEPS tokens, computing each mask, within a deadline. The server
(server/completions.py's `Server.constraint`) asks before it queues a constrained request, so a
grammar that crashes llguidance's native code (a 3,000-rule Lark chain segfaults it), one that
takes seconds to compile, or one that fails only once it runs ("max is 2000" items in a row) is a
400 at admission. The server then compiles it on one of two threads kept for that and hands the
engine a constrain.Compiled, so the engine thread never compiles.

    python -c "from server import constraint_check"     # library only; serve.py uses it

The child starts on the first constrained request and serves one check at a time; one that dies
(mid-check: a 400 for that constraint; while idle: the next check starts another) or runs past
the deadline is killed and replaced. Constraints that passed are remembered (the
newest CACHE_SIZE), so a schema used by every request is tried once. The engine then compiles it
again in its own process: that is the price of never compiling an untried grammar there.
"""

import json
import multiprocessing
import threading
from collections import OrderedDict

from constrain import Constraint

CACHE_SIZE = 256
STARTUP_S = 120.0
PROBE_STEPS = 8  # tokens walked into each constraint
MESSAGE_CHARS = 300  # of llguidance's error: its first line, never a Rust backtrace


def child(conn, tokenizer_source, vocab_size: int, stop_ids):
    """The child: compile each constraint it is sent, then its first mask; answer "" or the
    error."""
    from constrain import compile_constraint
    from formats.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_source)
    conn.send_bytes(b"ready")
    while True:
        c = json.loads(conn.recv_bytes())
        try:
            matcher = compile_constraint(
                Constraint(c["kind"], c["value"]), tokenizer, vocab_size, stop_ids
            )
            error = probe(matcher, vocab_size, set(stop_ids))
        except Exception as e:
            error = str(e) or type(e).__name__
        conn.send_bytes(error.encode())


def probe(matcher, vocab_size: int, stop_ids: set) -> str:
    """Walk PROBE_STEPS tokens into the constraint (the first allowed each time), computing each
    mask, where llguidance's run-time limits show ("Current row has 20001 items; max is 2000"
    comes at the second token of a grammar of 20,000 alternatives): "" or the error."""
    import torch

    for step in range(PROBE_STEPS):
        allowed = (
            torch.isfinite(matcher.mask_logits(torch.zeros(vocab_size))).nonzero().view(-1).tolist()
        )
        if matcher.error:
            return matcher.error
        going_on = [t for t in allowed if t not in stop_ids]
        if not going_on:  # complete (or, at the start, a $ref to itself: nothing can match)
            return (
                "" if step else "it allows no output at all (a schema that refers only to itself?)"
            )
        matcher.advance(going_on[0])
        if matcher.error:
            return matcher.error
    return ""


class CheckerUnavailable(RuntimeError):
    """The checker's child did not start or cannot be reached: the server's fault, a 503."""


class ConstraintChecker:
    """check(constraint): None if the engine can take it, else ValueError saying why."""

    def __init__(self, tokenizer_source, vocab_size: int, stop_ids=(), deadline_s: float = 10.0):
        self.args = (str(tokenizer_source), vocab_size, tuple(stop_ids))
        self.deadline_s, self.lock, self.passed = deadline_s, threading.Lock(), OrderedDict()
        self.process = self.conn = None

    def check(self, c: Constraint):
        key = json.dumps({"kind": c.kind, "value": c.value}, sort_keys=True)
        with self.lock:
            if key in self.passed:
                self.passed.move_to_end(key)
                return
            error = self._ask(key)
            if not error:
                self.passed[key] = True
                while len(self.passed) > CACHE_SIZE:
                    self.passed.popitem(last=False)
                return
        raise ValueError(error)

    def close(self):
        """End the child (serve.py's app does when it shuts down)."""
        with self.lock:
            if self.process is not None:
                self.process.kill()
                self.process.join(timeout=5)
                self.process = None

    def _send(self, key: str):
        """The constraint to a live child: one started if there is none, and once more if the
        one there died while idle (killed from outside: the pipe is broken)."""
        for attempt in range(2):
            if self.process is None or not self.process.is_alive():
                self._start()
            try:
                return self.conn.send_bytes(key.encode())
            except OSError as e:
                self.process.kill()
                self.process.join(timeout=5)
                self.process = None
                if attempt:
                    raise CheckerUnavailable(f"the constraint checker cannot be reached ({e})")

    def _ask(self, key: str) -> str:
        self._send(key)
        try:
            if self.conn.poll(self.deadline_s):
                first = self.conn.recv_bytes().decode().strip().splitlines()
                return f"invalid constraint: {first[0][:MESSAGE_CHARS]}" if first else ""
            self.process.kill()
            self.process.join(timeout=5)
            return (
                f"the constraint did not compile within {self.deadline_s:g} s "
                "(--constraint_timeout); simplify it"
            )
        except (EOFError, OSError):  # the child died on it
            self.process.join(timeout=5)
            return (
                f"the constraint crashed the grammar compiler (exit code {self.process.exitcode}); "
                "simplify it (fewer rules, a shallower schema)"
            )
        finally:
            if not self.process.is_alive():
                self.process = None

    def _start(self):
        ctx = multiprocessing.get_context(
            "spawn"
        )  # a fresh interpreter: no threads or locks inherited
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(
            target=child, args=(theirs, *self.args), daemon=True, name="constraint-check"
        )
        self.process.start()
        theirs.close()
        try:  # (torch and the tokenizer load)
            ready = self.conn.poll(STARTUP_S) and self.conn.recv_bytes() == b"ready"
        except (EOFError, OSError):  # it died while starting
            ready = False
        if not ready:
            self.process.kill()
            self.process.join(timeout=5)
            self.process = None  # the next check starts another
            raise CheckerUnavailable(f"the constraint checker did not start within {STARTUP_S:g} s")
