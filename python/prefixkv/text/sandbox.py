"""A Jinja environment in which a hostile chat template cannot hang, exhaust memory or escape
with an untyped error.

Chat templates come from checkpoints and from users. jinja2's `ImmutableSandboxedEnvironment`
stops a template from touching Python internals or mutating its inputs, but not from costing
without bound: ``{{ 'a' * 2000000000 }}`` allocates gigabytes, two nested ``range(100000)``
loops run 10^10 iterations, and ``{{ 1/0 }}`` or a recursive macro escape as plain Python
exceptions. `BoundedEnvironment` adds, per render (`RenderLimits`):

* a **step budget**: every loop iteration, function/method/macro call and intercepted operator
  is a step, and a wall-clock deadline is checked with them. Every ``{% for %}`` loop's iterable
  is wrapped at parse time (`_LoopGuard`), so even an empty loop body costs steps; recursion
  goes through calls. An infinite or astronomically long render stops at the budget.
* a **size limit**: no string or list a template builds may exceed `max_chars`. Growth is
  checked *before* the allocation where Python would allocate a lot in one call (``*``, ``**``,
  ``+``, ``%``, ``~``, block captures and macro bodies via ``environment.concat``, and the
  filters and ``str`` methods that can amplify: `join`, `replace`, `center`, `indent`,
  `format`, `wordwrap`, `sum`, ``ljust``/``rjust``/``zfill``/``expandtabs``, `tojson` indent),
  and after every other call, so accumulation in a loop stops at the first value over it.
  The caller streams the output (``Template.generate``) and counts it against the same limit.
* typed errors: the caller (`JinjaChatTemplate.render`) turns *every* exception from compiling
  or rendering into `ChatTemplateError`; the limits raise it directly.

What this does not do: limit the memory of values a template builds within the limits (a few
live values of `max_chars` each), nor interrupt one builtin call that is slow without growing
(sorting a huge input) - the inputs bound those. A render runs in the caller's thread.
"""

from __future__ import annotations

import contextvars
import functools
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes, pass_environment
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from prefixkv.errors import ChatTemplateError

__all__ = ["BoundedEnvironment", "RenderLimits"]

#: Longest ``range()`` a template may build (jinja2's sandbox uses the same figure).
MAX_RANGE = 100_000
#: Largest integer a template may compute, in bits (``**`` and ``*``).
MAX_INT_BITS = 100_000
#: Largest ``tojson`` indent (a deep input times a wide indent is an amplifier).
MAX_JSON_INDENT = 64

_STEPS_PER_CLOCK_READ = 256


@dataclass(frozen=True)
class RenderLimits:
    """What one render may cost. `max_chars` bounds every string or list the template builds
    and the rendered output; `max_steps` counts loop iterations, calls and intercepted
    operators; `max_seconds` is a wall-clock backstop read every few hundred steps."""

    max_chars: int
    max_steps: int
    max_seconds: float


class _Budget:
    def __init__(self, limits: RenderLimits, name: str) -> None:
        self.limits = limits
        self.name = name
        self.steps = 0
        self.deadline = time.monotonic() + limits.max_seconds

    def tick(self) -> None:
        self.steps += 1
        if self.steps > self.limits.max_steps:
            raise ChatTemplateError(
                f"chat template {self.name}: rendering took more than "
                f"{self.limits.max_steps} steps (loop iterations and calls)"
            )
        if self.steps % _STEPS_PER_CLOCK_READ == 0 and time.monotonic() > self.deadline:
            raise ChatTemplateError(
                f"chat template {self.name}: rendering took more than {self.limits.max_seconds} s"
            )

    def refuse_size(self, size: int, what: str) -> None:
        if size > self.limits.max_chars:
            raise ChatTemplateError(
                f"chat template {self.name}: {what} would be {size} long, over the limit of "
                f"{self.limits.max_chars}"
            )

    def check_value(self, value: Any, what: str) -> Any:
        if isinstance(value, (str, bytes, list, tuple)):
            self.refuse_size(len(value), what)
        return value


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "prefixkv_template_budget", default=None
)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:  # compiled templates are only run through `BoundedEnvironment.run`
        raise ChatTemplateError("a bounded template ran outside BoundedEnvironment.run")
    return budget


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else len(str(value))


def _int_over(value: Any, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit


# --------------------------------------------------------------------------------------------
# Estimates of what an amplifying operation would allocate, made before it runs
# --------------------------------------------------------------------------------------------

_WIDTH = re.compile(r"\d+")


def _check_format_string(budget: _Budget, template: str, args: Iterable[Any]) -> None:
    """``%`` / ``format`` / ``str.format``: widths and precisions are digits in the format
    string, or (``*``, nested ``{}``) come from the arguments."""
    limit = budget.limits.max_chars
    for match in _WIDTH.finditer(template):
        if len(match.group()) > 7 or int(match.group()) > limit:
            budget.refuse_size(int(match.group()[:12]), "a formatted field")
    if "*" in template or re.search(r"\{[^{}]*\{", template):
        for value in args:
            if _int_over(value, limit):
                budget.refuse_size(abs(value), "a formatted field")


def _check_binop(budget: _Budget, operator: str, left: Any, right: Any) -> None:
    limit = budget.limits.max_chars
    sequence = (str, bytes, list, tuple)
    if operator == "*":
        if isinstance(left, sequence) and isinstance(right, int):
            budget.refuse_size(len(left) * max(right, 0), "a repeated sequence")
        elif isinstance(right, sequence) and isinstance(left, int):
            budget.refuse_size(len(right) * max(left, 0), "a repeated sequence")
        elif (
            isinstance(left, int)
            and isinstance(right, int)
            and left.bit_length() + right.bit_length() > MAX_INT_BITS
        ):
            raise ChatTemplateError(
                f"chat template {budget.name}: integer product over {MAX_INT_BITS} bits"
            )
    elif operator == "**":
        if (
            isinstance(left, int)
            and isinstance(right, int)
            and right > 0
            and abs(left) > 1
            and (right > MAX_INT_BITS or left.bit_length() * right > MAX_INT_BITS)
        ):
            raise ChatTemplateError(
                f"chat template {budget.name}: integer power over {MAX_INT_BITS} bits"
            )
    elif operator == "+":
        if isinstance(left, sequence) and isinstance(right, sequence):
            budget.refuse_size(len(left) + len(right), "a concatenation")
    elif operator == "%" and isinstance(left, str):
        _check_format_string(budget, left, right if isinstance(right, tuple) else (right,))
        if limit < len(left):
            budget.refuse_size(len(left), "a formatted string")


def _replace_size(text: str, old: Any, new: Any) -> int:
    old, new = str(old), str(new)
    occurrences = text.count(old) if old else len(text) + 1
    return len(text) + occurrences * max(0, len(new) - len(old))


def _join_size(items: list[Any], separator: Any) -> int:
    return sum(_length(item) for item in items) + len(str(separator)) * max(len(items) - 1, 0)


# Per-method pre-checks for `str` methods a template can call: (receiver, args, kwargs) -> size.
_STR_METHODS: dict[str, Callable[[str, tuple[Any, ...], dict[str, Any]], int]] = {
    "center": lambda s, a, k: max(len(s), *(v for v in a[:1] if isinstance(v, int)), 0),
    "ljust": lambda s, a, k: max(len(s), *(v for v in a[:1] if isinstance(v, int)), 0),
    "rjust": lambda s, a, k: max(len(s), *(v for v in a[:1] if isinstance(v, int)), 0),
    "zfill": lambda s, a, k: max(len(s), *(v for v in a[:1] if isinstance(v, int)), 0),
    "expandtabs": lambda s, a, k: (
        len(s) + s.count("\t") * max(0, int((a or [k.get("tabsize", 8)])[0]))
    ),
    "replace": lambda s, a, k: _replace_size(s, *a[:2]) if len(a) >= 2 else len(s),
}


# --------------------------------------------------------------------------------------------
# Filters: the amplifying ones are checked before they run, every one after
# --------------------------------------------------------------------------------------------


def _prechecked_filter(
    name: str, budget: _Budget, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """Refuse a filter call whose result would be over the size limit, before it runs.
    `args` are the filter's arguments after any context/environment argument; returned as the
    filter should receive them (an iterable `join` consumes is materialised once here)."""
    if not args:
        return args
    value, rest = args[0], args[1:]
    limit = budget.limits.max_chars
    if name == "join":
        items = list(value)
        budget.refuse_size(len(items), "a joined sequence")
        separator = rest[0] if rest else kwargs.get("d", "")
        budget.refuse_size(_join_size(items, separator), "a joined string")
        return (items, *rest)
    elif name == "replace" and len(rest) >= 2:
        budget.refuse_size(_replace_size(str(value), rest[0], rest[1]), "a replaced string")
    elif name == "center":
        width = rest[0] if rest else kwargs.get("width", 80)
        if _int_over(width, limit):
            budget.refuse_size(abs(width), "a centred string")
    elif name == "indent":
        width = rest[0] if rest else kwargs.get("width", 4)
        text = str(value)
        step = len(width) if isinstance(width, str) else int(width)
        budget.refuse_size(len(text) + (text.count("\n") + 1) * max(step, 0), "an indented string")
    elif name == "format":
        _check_format_string(budget, str(value), list(rest) + list(kwargs.values()))
    elif name == "wordwrap":
        width = rest[0] if rest else kwargs.get("width", 79)
        wrapstring = rest[2] if len(rest) >= 3 else kwargs.get("wrapstring") or "\n"
        text = str(value)
        lines = len(text) // max(int(width), 1) + 1
        budget.refuse_size(len(text) + lines * len(str(wrapstring)), "a wrapped string")
    elif name in ("batch", "slice"):
        count = rest[0] if rest else kwargs.get("linecount", kwargs.get("slices", 1))
        if _int_over(count, limit):
            budget.refuse_size(abs(count), f"a {name} of a sequence")
    return args


@pass_environment
def _bounded_sum(
    environment: Any, iterable: Iterable[Any], attribute: Any = None, start: Any = 0
) -> Any:
    """jinja2's `sum`, without its quadratic (and unbounded) behaviour on lists: a sum of
    lists (or of tuples) onto a list (tuple) `start` is one concatenation, after its total size
    is checked. Anything else is Python's `sum`, as in jinja2."""
    from jinja2.filters import make_attrgetter

    items = list(iterable)
    budget = _budget()
    budget.refuse_size(len(items), "a summed sequence")
    if attribute is not None:
        getter = make_attrgetter(environment, attribute)
        items = [getter(item) for item in items]
    if isinstance(start, (list, tuple)) and all(isinstance(item, type(start)) for item in items):
        budget.refuse_size(len(start) + sum(len(item) for item in items), "a sum")
        total = list(start)
        for item in items:
            budget.tick()
            total.extend(item)
        return total if isinstance(start, list) else tuple(total)
    return sum(items, start)


def _bound_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    pass_arg = getattr(function, "jinja_pass_arg", None)
    skip = 1 if pass_arg is not None else 0

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        args = (*args[:skip], *_prechecked_filter(name, budget, args[skip:], kwargs))
        return budget.check_value(function(*args, **kwargs), f"the result of filter {name!r}")

    return bounded


# --------------------------------------------------------------------------------------------
# Parse-time and compile-time hooks
# --------------------------------------------------------------------------------------------


class _LoopGuard(NodeTransformer):
    """Wraps every ``{% for %}`` iterable in ``environment.prefixkv_iterate(...)``, so every
    iteration costs a step even when the loop body does nothing."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        visited = self.generic_visit(node)
        assert isinstance(visited, nodes.For)
        node = visited
        node.iter = nodes.Call(
            nodes.EnvironmentAttribute("prefixkv_iterate", lineno=node.lineno),
            [node.iter],
            [],
            None,
            None,
            lineno=node.lineno,
        )
        return node


class _BoundedCodeGenerator(CodeGenerator):
    """``a ~ b`` compiles to ``str_join``, which no sandbox hook sees; route it through
    `BoundedEnvironment.prefixkv_str_join`, which checks the size before joining."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super().visit_Concat(node, frame)
            return
        self.write("environment.prefixkv_str_join((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with the per-render limits described in the module essay.

    Templates compiled here must be run with `run`, which installs the budget and streams the
    output against `RenderLimits.max_chars`.
    """

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals["range"] = _bounded_range
        self.filters["sum"] = _bounded_sum
        self.filters = {name: _bound_filter(name, f) for name, f in self.filters.items()}

    def add_filter(self, name: str, function: Callable[..., Any]) -> None:
        """Register a filter behind the same checks as the built-in ones."""
        self.filters[name] = _bound_filter(name, function)

    # -- hooks jinja2 calls --------------------------------------------------------------
    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        guarded = _LoopGuard().visit(tree)
        assert isinstance(guarded, nodes.Template)
        return guarded

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.tick()
        _check_binop(budget, operator, left, right)
        result = super().call_binop(context, operator, left, right)
        return budget.check_value(result, f"the result of {operator!r}")

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        # The sandbox hands out `str.format` wrapped (functools.update_wrapper keeps the name).
        receiver = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(receiver, str):
            method = getattr(__obj, "__name__", "")
            estimate = _STR_METHODS.get(method)
            if estimate is not None:
                budget.refuse_size(estimate(receiver, args, kwargs), f"str.{method}()")
            elif method in ("format", "format_map"):
                values = list(args) + list(kwargs.values())
                for mapping in values if method == "format_map" else ():
                    if isinstance(mapping, dict):
                        values.extend(mapping.values())
                _check_format_string(budget, receiver, values)
            elif method == "join" and args:
                items = list(args[0])
                budget.refuse_size(_join_size(items, receiver), "str.join()")
                args = (items, *args[1:])
        result = super().call(__context, __obj, *args, **kwargs)
        return budget.check_value(result, "the result of a call")

    def concat(self, parts: Iterable[str]) -> str:  # type: ignore[override]
        """Joins a block's output (``{% set %}`` blocks, macro bodies, filter and call
        blocks): checked before joining."""
        parts = list(parts)
        budget = _BUDGET.get()
        if budget is not None:
            budget.refuse_size(sum(len(part) for part in parts), "a block's output")
        return "".join(parts)

    # -- callables the compiled code reaches through `environment.` ---------------------
    def prefixkv_iterate(self, iterable: Any) -> Iterator[Any]:
        budget = _budget()
        for item in iterable:
            budget.tick()
            yield item

    def prefixkv_str_join(self, parts: tuple[Any, ...]) -> str:
        strings = [str(part) for part in parts]
        _budget().refuse_size(sum(len(s) for s in strings), "a '~' concatenation")
        return "".join(strings)

    # -- running -------------------------------------------------------------------------
    def run(self, template: Any, context: dict[str, Any], limits: RenderLimits, name: str) -> str:
        """Render `template` with `context` under `limits`; the output is streamed and
        counted. Raises `ChatTemplateError` for a broken limit; other exceptions from the
        template propagate for the caller to type."""
        budget = _Budget(limits, name)
        token = _BUDGET.set(budget)
        try:
            chunks: list[str] = []
            total = 0
            for chunk in template.generate(**context):
                total += len(chunk)
                budget.refuse_size(total, "the rendered prompt")
                chunks.append(chunk)
            return "".join(chunks)
        finally:
            _BUDGET.reset(token)


def _bounded_range(*args: int) -> range:
    name = _budget().name
    for value in args:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ChatTemplateError(f"chat template {name}: range() takes integers, got {value!r}")
    numbers = range(*args)
    try:
        count = len(numbers)
    except OverflowError:  # more numbers than sys.maxsize
        count = MAX_RANGE + 1
    if count > MAX_RANGE:
        shown = ", ".join(str(value) for value in args)
        raise ChatTemplateError(
            f"chat template {name}: range({shown}) has more than {MAX_RANGE} numbers, the most "
            "a template may build"
        )
    return numbers
