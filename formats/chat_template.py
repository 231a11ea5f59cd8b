"""Chat templates rendered in a sandbox that bounds what they may build and how long they may run.
A template is code from a file written by someone else: jinja2's sandbox stops attribute walks
(`__class__`, `__globals__`) but not `'a' * 10**10`, `range(99999)` nested in itself,
`'{:>9999999999}'.format(1)`, or a string doubled forty times by `~`. Here every way a template
builds a string or list is bounded before it allocates: repetition (`*`), concatenation (`+`,
`~`, which jinja compiles to a join of its own, so the code generator is replaced), `%` and
`.format` (their widths and their output's size), the string filters (`join`, `center`, ...);
results are checked too, and a trace on the template's frames holds a deadline, loops included.

    from formats.chat_template import render_chat_template
    text = render_chat_template(template, [{"role": "user", "content": "hi"}])

Any failure is a TokenizerError saying what the template tried.
"""

import datetime
import json
import math
import re
import sys
import time

from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime import TokenizerError

# What one render of a chat template may build and spend.
TEMPLATE_MAX_CHARS = 2**24  # of any string or list the template builds, and of its output
TEMPLATE_MAX_SECONDS = 2.0


def check_size(value):
    if isinstance(value, (str, list, tuple, bytes)) and len(value) > TEMPLATE_MAX_CHARS:
        raise SecurityError(
            f"the template built a value of {len(value)} items (limit {TEMPLATE_MAX_CHARS})"
        )
    return value


def check_args(args, kwargs):  # widths, counts and repeats beyond what any output may hold
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > TEMPLATE_MAX_CHARS:
            raise SecurityError(
                f"the template passed {a}, beyond the limit of {TEMPLATE_MAX_CHARS}"
            )


def check_total(parts, what: str):  # before joining: the sizes of the parts
    total = sum(len(p) if isinstance(p, (str, list, tuple)) else len(str(p)) for p in parts)
    if total > TEMPLATE_MAX_CHARS:
        raise SecurityError(f"the template {what} {total} characters (limit {TEMPLATE_MAX_CHARS})")


def bounded_filter(f, name):
    def wrapper(*args, **kwargs):
        check_args(args, kwargs)
        if name == "join" and len(args) > 1 and isinstance(args[1], (list, tuple)):
            check_total(
                list(args[1]) + [str(args[2]) if len(args) > 2 else ""] * len(args[1]), "joins"
            )
        return check_size(f(*args, **kwargs))

    wrapper.__dict__.update(
        getattr(f, "__dict__", {})
    )  # keeps jinja's pass_context / pass_environment marks
    return wrapper


class BoundedCodeGenerator(CodeGenerator):
    def visit_Concat(self, node, frame):  # `a ~ b`: through the environment's bounded join
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "+", "%"])
    code_generator_class = BoundedCodeGenerator

    def __init__(self, **kw):
        super().__init__(**kw)
        self.filters = {name: bounded_filter(f, name) for name, f in self.filters.items()}

    @staticmethod
    def bounded_concat(parts):
        check_total(parts, "concatenates")
        return "".join(map(str, parts))

    def unsafe_undefined(self, obj, attribute):  # an attribute walk fails now, not silently as ""
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__} is unsafe"
        )

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if (
                    isinstance(seq, (str, list, tuple))
                    and isinstance(times, int)
                    and len(seq) * times > TEMPLATE_MAX_CHARS
                ):
                    raise SecurityError(
                        f"the template repeats a value {times} times "
                        f"(limit {TEMPLATE_MAX_CHARS} items)"
                    )
        if (
            operator == "**"
            and isinstance(left, (int, float))
            and isinstance(right, (int, float))
            and abs(left) > 1
            and right * math.log2(abs(left)) > 4096
        ):
            raise SecurityError(f"the template computes {left} ** {right}, a number over 4096 bits")
        if (
            operator == "+"
            and isinstance(left, (str, list, tuple))
            and isinstance(right, (str, list, tuple))
        ):
            check_total((left, right), "adds up")
        if operator == "%" and isinstance(left, str):
            check_args(right if isinstance(right, tuple) else (right,), {})
            if re.search(
                r"%[-+ #0]*\d{7,}|%[-+ #0]*\d*\.\d{7,}", left
            ):  # '%9999999999s': a width no output holds
                raise SecurityError("the template formats with a width beyond any output")
            check_total((left,) + (right if isinstance(right, tuple) else (right,)), "formats")
        return check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):
        check_args(args, kwargs)
        bound_to = getattr(
            getattr(__obj, "__wrapped__", __obj), "__self__", None
        )  # the sandbox wraps str.format
        if isinstance(bound_to, str) and re.search(r"\d{7,}", bound_to):
            raise SecurityError("the template formats with a width beyond any output")
        if (
            isinstance(bound_to, str) and getattr(__obj, "__name__", "") == "format"
        ):  # fields x arguments
            check_total(
                [bound_to] + [a for a in args for _ in range(max(1, bound_to.count("{")))],
                "formats",
            )
        try:
            return check_size(super().call(__context, __obj, *args, **kwargs))
        except OverflowError as e:  # the sandbox's own range() limit
            raise SecurityError(str(e)) from None


def _with_deadline(render, seconds: float):
    """render() stopped after `seconds`: a trace on the template's own frames (their code is
    named "<template>") checks the clock every 1024 lines, loops without output included."""
    deadline, lines = time.monotonic() + seconds, 0

    def on_line(frame, event, arg):
        nonlocal lines
        lines += 1
        if lines % 1024 == 0 and time.monotonic() > deadline:
            raise SecurityError(f"the template ran for more than {seconds:g} s")
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return render()
    finally:
        sys.settrace(previous)


def strftime_now(fmt) -> str:
    """Today's date for a template (transformers gives templates this; gpt-oss's dates its system
    message): plain directives only, so no field width (glibc's %999999999Y) can make it large."""
    if not isinstance(fmt, str) or len(fmt) > 64 or re.search(r"%[^a-zA-Z%]", fmt):
        raise TemplateError(
            "strftime_now takes a format of at most 64 characters without widths, "
            f"got {str(fmt)[:80]!r}"
        )
    return datetime.datetime.now().strftime(fmt)


def render_chat_template(template: str, messages, add_generation_prompt=True, **extra) -> str:
    """The template rendered in a sandbox that also bounds what it may build and how long it may
    run; any failure is a TokenizerError."""

    def raise_exception(message):
        raise TemplateError(message)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now

    def render():
        out, size = [], 0
        for part in env.from_string(template).generate(
            messages=messages, add_generation_prompt=add_generation_prompt, **extra
        ):
            out.append(part)
            size += len(part)
            if size > TEMPLATE_MAX_CHARS:
                raise TemplateError(
                    f"the template's output exceeds {TEMPLATE_MAX_CHARS} characters"
                )
        return "".join(out)

    try:
        return _with_deadline(render, TEMPLATE_MAX_SECONDS)
    except (TemplateError, OverflowError, MemoryError, RecursionError) as e:
        raise TokenizerError(f"chat template failed: {e}") from None
