"""``kvrouter up``'s options, each declared once: on the config field it sets (``STYLE.md`` §11).

An option is the ``metadata`` of the dataclass field it fills: :class:`~kvrouter.service.core.config.
ServiceConfig`'s, the :class:`~kvrouter.routing.config.RouterConfig` fields the ``--router-*`` flags set,
:class:`~kvrouter.plane.config.PlaneConfig`'s subscriber bounds and the demo's
:class:`~kvrouter.demo.fleet.EmbeddedConfig`. Everything else about the option follows from that one
:class:`Option`:

- **its name**, the first flag in Python spelling (``--router-kv-events`` → ``router_kv_events``): the
  ``--config`` TOML key (dashes or underscores, top level or ``[up]``) and the key of ``--print-config``'s
  ``sources``;
- **its variables**, ``KVROUTER_`` and the name upper-cased, unless ``env`` names them
  (``--nats-url`` reads ``KVROUTER_NATS_URL`` then ``NATS_SERVER``);
- **its default**, the field's; for a field of a nested config, the nested default's value (the
  ``--router-*`` flags start from ``ServiceConfig.router``'s default, kvrouter's tuned
  ``KVROUTER_CONFIG``, not from ``RouterConfig()``);
- **its type**, the field's (``X | None`` when the default is None; a ``Literal`` is taken as ``str``
  so the dataclass refuses a bad value with its own message), or ``value_type`` with ``convert`` when the
  command line spells it otherwise (``--shadow-policy a,b`` → ``shadow_policies=("a", "b")``);
- **its place in** ``kvrouter up --help``: its :class:`Panel`, in the order the fields are declared.

``kvrouter/cli/up.py`` generates the typer command from :func:`declared` (one ``typer.Option`` per
declaration, flags, variables, help, bounds and panel copied from it), and builds the configs from the
values click resolved with :func:`build`; click alone resolves precedence, flag > variable > ``--config``
file > default. ``tests/test_options.py`` walks the declarations against the generated command.

**Adding an option** touches one place, the field of the config that uses it::

    drain_secs: float = field(
        default=5.0,
        metadata=option("--drain-secs", help="[secs] How long SIGTERM waits.", panel=Panel.SERVER, min=0.0),
    )

The flag, ``KVROUTER_DRAIN_SECS``, the TOML key ``drain_secs``, the help line under "Server" with its
default, and the value and source in ``--print-config`` all follow; ``kvrouter up`` passes the value to
the config it builds. A config class new to ``kvrouter up`` is reached as a field whose default is an
instance of it (walked like ``ServiceConfig.router``), or added to the roots of ``OPTIONS`` in
``cli/up.py``. A field ``kvrouter up`` does not set carries no metadata, and ``tests/test_options.py``
lists it with its reason, so a new field is a decision, not an oversight. Fields that take another
option's value (the demo's ``block_size``) say so with :func:`shared`; fields ``kvrouter up`` works out
from several (the demo's ``first_worker_id``) with :func:`derived`.

Rejected: a settings library (pydantic-settings, dynaconf). The precedence is already click's own
per-parameter resolution (command line, ``envvar``, ``ctx.default_map``, default), which also names each
value's source for ``--print-config``; a library would resolve a second time, beside click, and bring a
dependency and a second validation beside the dataclasses' ``__post_init__``, whose messages the tests
and operators know. This module imports neither typer nor click: the configs stay free of the CLI.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "ENV_PREFIX",
    "Declared",
    "Option",
    "Panel",
    "build",
    "declared",
    "derived",
    "kind",
    "option",
    "printed",
    "shared",
]

ENV_PREFIX: Final = "KVROUTER_"
"""An option's variable unless it names its own: ``KVROUTER_`` + its name upper-cased (``spec/interfaces.md`` §5)."""

_OPTION: Final = "kvrouter.option"
_SHARED: Final = "kvrouter.option.shared"
_DERIVED: Final = "kvrouter.option.derived"

C = TypeVar("C", bound="DataclassInstance")


class Panel(enum.StrEnum):
    """The groups of ``kvrouter up --help``, in the order they are shown."""

    SERVER = "Server"
    WORKERS = "Workers"
    COST = "Routing cost"
    DISAGG = "Disaggregated serving (workers of role prefill and decode)"
    EVENTS = "KV events"
    OVERLOAD = "Overload"
    PROXY = "Proxy and sessions (POST /v1/completions)"
    SYNC = "Replica sync (NATS; docs/nats-bridge.md)"
    DEMO = "Embedded demo (no --workers)"
    CONFIG = "Configuration"
    """``--config`` and ``--print-config``: the command's own, declared in ``cli/up.py``."""


@dataclass(frozen=True, slots=True)
class Option:
    """One command-line option of ``kvrouter up``, declared on the field it sets (see the module docstring)."""

    flags: tuple[str, ...]
    """The first names the option; the others are aliases (``--router-event-threads`` of ``--shards``)."""
    help: str
    """Plain text (the CLI escapes rich markup); a unit goes first in brackets: ``[secs] ...``."""
    panel: Panel
    env: tuple[str, ...] = ()
    """Its environment variables, first found wins; empty: ``KVROUTER_<NAME>``."""
    negatable: bool = False
    """A boolean with a ``--no-`` form (``--router-kv-events/--no-router-kv-events``); else a plain flag."""
    min: float | None = None
    max: float | None = None
    metavar: str | None = None
    show_default: bool | str = True
    """What ``--help`` shows as the default: the value (True), nothing (False) or this text, e.g. ``"off"``."""
    optional: bool = False
    """Left unset, the option's value is None and the field keeps the dataclass's own default, which the
    dataclass or ``kvrouter up`` resolves from other settings (``--zmq-port``: ``--port`` + 1)."""
    value_type: type | None = None
    """The option's value type when the command line spells the field otherwise (with ``convert``)."""
    convert: Callable[[Any], Any] | None = None
    """Option value → field value (``"a, b"`` → ``("a", "b")``); None: the value as click resolved it."""
    secret: bool = False
    """``--print-config`` shows ``"<set>"``, never the value."""
    multiple: bool = False
    """Repeatable (``--model-path a=DIR --model-path b=DIR``; a list in TOML): ``convert`` gets the values as a
    list. Needs ``optional``."""

    @property
    def name(self) -> str:
        """The parameter's name, TOML key and ``--print-config`` source key: the first flag, underscored."""
        return self.flags[0].removeprefix("--").replace("-", "_")

    @property
    def envvars(self) -> tuple[str, ...]:
        return self.env or (ENV_PREFIX + self.name.upper(),)

    @property
    def declarations(self) -> tuple[str, ...]:
        """The flags as click takes them: ``"--x/--no-x"`` for a negatable boolean."""
        first, *aliases = self.flags
        return (f"{first}/--no-{first.removeprefix('--')}" if self.negatable else first, *aliases)


def option(*flags: str, help: str, panel: Panel, **more: Any) -> dict[str, Option]:
    """A field's ``metadata``: the field is set by this option (``Option``'s fields as keywords)."""
    return {_OPTION: Option(flags, help, panel, **more)}


def shared(name: str) -> dict[str, str]:
    """A field's ``metadata``: the field takes the value of the option ``name`` declared on another config
    (the demo's ``block_size`` is the service's ``--block-size``); that option's ``convert`` is not applied."""
    return {_SHARED: name}


def derived(why: str) -> dict[str, str]:
    """A field's ``metadata``: ``kvrouter up`` works this field out from other options (``why`` says how) and
    passes it to :func:`build`; ``--print-config`` shows it."""
    return {_DERIVED: why}


@dataclass(frozen=True, slots=True)
class Declared:
    """An option found by :func:`declared`, with the field it sets."""

    option: Option
    owner: type
    """The dataclass the field belongs to."""
    field: str
    path: tuple[str, ...]
    """Field names from the root config: ``("router", "overlap_score_credit")``."""
    default: Any
    """The option's default: the field's, or the nested default instance's value."""
    hint: Any
    """The field's type, resolved."""


def declared(*roots: type[DataclassInstance]) -> tuple[Declared, ...]:
    """Every option declared on the roots' fields and on their nested configs', in field order.

    Raises:
        ValueError: two options with one name, or a :func:`shared` field naming no option.
    """
    found = tuple(d for root in roots for d in _walk(root, None, ()))
    names = [d.option.name for d in found]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"option {name!r} is declared {names.count(name)} times")
    for root in roots:
        for cls, spec in _fields(root, None):
            if _SHARED in spec.metadata and spec.metadata[_SHARED] not in names:
                raise ValueError(f"{cls.__name__}.{spec.name} shares option {spec.metadata[_SHARED]!r}, never declared")
    return found


def build(cls: type[C], values: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> C:
    """An instance of ``cls`` from option values (name → value, as click resolved them).

    Each option's field gets its value (converted; an unset ``optional`` one leaves the field's default),
    each :func:`shared` field the named option's value, each nested config its default with its own
    options applied, and ``overrides`` (field → value) win over all of these.

    Raises:
        ConfigError: a value the dataclass refuses (its ``__post_init__``).
    """
    return cls(**_values(cls, values, None, overrides or {}))


def printed(config: DataclassInstance) -> dict[str, Any]:
    """The fields of ``config`` that ``kvrouter up`` sets, in field order: its options' (a secret as
    ``"<set>"``), shared and derived fields, and nested configs whole."""
    out: dict[str, Any] = {}
    for spec in dataclasses.fields(config):
        value = getattr(config, spec.name)
        declaration = spec.metadata.get(_OPTION)
        if declaration is not None:
            out[spec.name] = "<set>" if declaration.secret and value is not None else value
        elif _SHARED in spec.metadata or _DERIVED in spec.metadata or _nested(value):
            out[spec.name] = value
    return out


def kind(spec: dataclasses.Field[Any]) -> str | None:
    """What declares a field: ``"option"``, ``"shared"``, ``"derived"``, or None (nested or not set)."""
    for key, name in ((_OPTION, "option"), (_SHARED, "shared"), (_DERIVED, "derived")):
        if key in spec.metadata:
            return name
    return None


def _walk(cls: type[DataclassInstance], base: object, path: tuple[str, ...]) -> Iterator[Declared]:
    hints = _hints(cls)
    for spec in dataclasses.fields(cls):
        default = _default(spec, base)
        declaration = spec.metadata.get(_OPTION)
        if declaration is not None:
            yield Declared(declaration, cls, spec.name, (*path, spec.name), default, hints[spec.name])
        elif kind(spec) is None and _nested(default):
            yield from _walk(type(default), default, (*path, spec.name))


def _fields(cls: type[DataclassInstance], base: object) -> Iterator[tuple[type, dataclasses.Field[Any]]]:
    """Every field of ``cls`` and of its nested configs, with its class."""
    for spec in dataclasses.fields(cls):
        yield cls, spec
        default = _default(spec, base)
        if kind(spec) is None and _nested(default):
            yield from _fields(type(default), default)


def _values(
    cls: type[DataclassInstance], values: Mapping[str, Any], base: object, overrides: Mapping[str, Any]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in dataclasses.fields(cls):
        if spec.name in overrides:
            out[spec.name] = overrides[spec.name]
            continue
        declaration: Option | None = spec.metadata.get(_OPTION)
        default = _default(spec, base)
        if declaration is not None:
            value = values[declaration.name]
            if value is None and declaration.optional:
                continue
            out[spec.name] = declaration.convert(value) if declaration.convert is not None else value
        elif _SHARED in spec.metadata:
            out[spec.name] = values[spec.metadata[_SHARED]]
        elif kind(spec) is None and _nested(default):
            out[spec.name] = dataclasses.replace(default, **_values(type(default), values, default, {}))
    return out


def _hints(cls: type[DataclassInstance]) -> dict[str, Any]:
    """The fields' types, resolved in the module that defined ``cls``: its ``__module__`` may name the package
    that re-exports it (``kvrouter`` presents its public classes so), whose namespace lacks the module's
    imports; the ``__init__`` the dataclass generated keeps the defining module's globals."""
    return typing.get_type_hints(cls, globalns=getattr(cls.__init__, "__globals__", None))


def _default(spec: dataclasses.Field[Any], base: object) -> Any:
    if base is not None:
        return getattr(base, spec.name)
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return None if spec.default is dataclasses.MISSING else spec.default


def _nested(value: object) -> bool:
    """A config inside a config (``ServiceConfig.router``), walked for options when its class declares any."""
    return (
        dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and any(kind(spec) is not None or _nested(getattr(value, spec.name)) for spec in dataclasses.fields(value))
    )
