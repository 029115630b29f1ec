"""A job kind's parameters as a frozen dataclass: parsing and wire form come from its fields.

Each field is declared with :func:`param`: how its raw value is parsed (with the schema and
the fields parsed before it), how it travels, when it is left out of the canonical mapping
(so that jobs made before a parameter existed keep their bytes), and its command-line flag.
The unknown-key check, :meth:`Params.parse` and :meth:`Params.to_mapping` need nothing else;
a kind adds cross-field rules in :meth:`Params.validate` and its budget split in
:meth:`Params.shares`. The coordinator and every site parse the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Self

from dpfed.common.errors import ValidationError

if TYPE_CHECKING:
    from dpfed.common.data.schema import Schema


class Aggregation(StrEnum):
    """How a job's sums travel: each site noises its own, or one secure sum of all."""

    SITE = "site"
    SECURE = "secure"


@dataclass(frozen=True)
class ParseContext:
    """What a field's parser sees: the schema (None at a client) and the fields parsed so far."""

    schema: Schema | None
    parsed: Mapping[str, Any]
    raw: Mapping[str, Any]


#: ``parser(raw value, context) -> value``; raises ValidationError naming the parameter.
Parser = Callable[[Any, ParseContext], Any]


@dataclass(frozen=True)
class ParamSpec:
    """How one field is parsed, sent and offered (see :func:`param`)."""

    parse: Parser | None = None
    derive_default: Callable[[ParseContext], Any] | None = None
    wire: Callable[[Any], Any] | None = None
    omit: Callable[[Any], bool] | None = None
    required: str = ""
    flag: str = ""
    help: str = ""


def param(default: Any = dataclasses.MISSING, *, parse: Parser | None = None,
          derive_default: Callable[[ParseContext], Any] | None = None,
          wire: Callable[[Any], Any] | None = None, omit: Callable[[Any], bool] | None = None,
          required: str = "", flag: str = "", help: str = "") -> Any:  # noqa: A002
    """Declare a parameter field.

    Parameters
    ----------
    default
        The value when the key is absent (``derive_default(context)`` computes it instead).
    parse
        Validates and converts the raw value (also the default, when the key is absent).
    wire
        Converts the value for the canonical mapping (default: as it is).
    omit
        ``omit(params)`` True leaves the field out of the canonical mapping.
    required
        The error message when a field without default is absent.
    flag, help
        The command-line flag and its help (a kind's generic command).
    """
    spec = ParamSpec(parse, derive_default, wire, omit, required, flag, help)
    if default is dataclasses.MISSING and derive_default is None:
        return dataclasses.field(metadata={"param": spec})
    return dataclasses.field(default=None if default is dataclasses.MISSING else default,
                             metadata={"param": spec})


def spec_of(f: dataclasses.Field[Any]) -> ParamSpec:
    """Return a field's :class:`ParamSpec` (fields declared without :func:`param`: defaults)."""
    found = f.metadata.get("param")
    return found if isinstance(found, ParamSpec) else ParamSpec()


@dataclass(frozen=True)
class RoundShare:
    """One round of a job's budget split: its name and what its task carries.

    ``charged`` is False for a task covered by an earlier charge or free; ``optional`` rounds
    are asked only of the sites that can take them.
    """

    name: str
    epsilon: float
    delta: float
    charged: bool = True
    optional: bool = False


@dataclass(frozen=True)
class ConnectedSite:
    """What a job's plan may read of a connected site: rows, accountant, secure policy.

    ``secure_tolerated`` colluders and ``secure_dropouts`` dropouts of its secure-aggregation
    policy (``secure_tolerated`` None: the site takes no secure sums).
    """

    row_count: int
    accountant: str | None
    secure_tolerated: int | None = None
    secure_dropouts: int = 0


class Params:
    """Base of a job kind's parameters (a frozen dataclass; module docstring)."""

    #: The job kind's name (error messages).
    kind: ClassVar[str]
    #: Values a job being submitted gets for keys its analyst left out, where they differ from
    #: the fields' defaults (which stay what a stored job without the key means, so that jobs
    #: made before a parameter existed parse and re-serialise unchanged): :meth:`submitted`.
    new_job_defaults: ClassVar[Mapping[str, Any]] = {}

    @classmethod
    def submitted(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        """Return a new job's raw parameters with :attr:`new_job_defaults` filled in."""
        if not isinstance(raw, Mapping):
            raise ValidationError(f"{cls.kind} parameters must be a mapping, got {raw!r}")
        return {**cls.new_job_defaults, **raw}
    #: True when :meth:`settle` may fill parameters from the connected sites at submission.
    settles: ClassVar[bool] = False

    @classmethod
    def parse(cls, raw: Mapping[str, Any], schema: Schema | None) -> Self:
        """Validate raw parameters; ``schema`` None skips what needs it (a client's --plan)."""
        if not isinstance(raw, Mapping):
            raise ValidationError(f"{cls.kind} parameters must be a mapping, got {raw!r}")
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        extra = sorted(set(raw) - set(names))
        if extra:
            raise ValidationError(f"unknown {cls.kind} parameter(s) {extra}; known: "
                                  f"{sorted(names)}")
        parsed: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            spec = spec_of(f)
            context = ParseContext(schema, parsed, raw)
            if f.name in raw:
                value = raw[f.name]
            elif spec.derive_default is not None:
                value = spec.derive_default(context)
            elif f.default is not dataclasses.MISSING:
                value = f.default
            else:
                raise ValidationError(spec.required or f"{cls.kind} needs {f.name}")
            parsed[f.name] = value if spec.parse is None else spec.parse(value, context)
        params = cls(**parsed)
        params.validate(schema)
        return params

    def validate(self, schema: Schema | None) -> None:
        """Check rules between fields (raises ValidationError); default: none."""
        del schema

    def settle(self, epsilon: float, delta: float, schema: Schema,
               sites: Sequence[ConnectedSite]) -> Self:
        """Return the parameters a new job runs with, given the public facts of its sites.

        Called once, when the job is submitted (the result is stored: a resumed job never
        settles again); default: unchanged.
        """
        del epsilon, delta, schema, sites
        return self

    def to_mapping(self) -> dict[str, Any]:
        """Return the canonical mapping sent to sites (deterministic: resumed jobs resend it)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            spec = spec_of(f)
            if spec.omit is not None and spec.omit(self):
                continue
            value = getattr(self, f.name)
            out[f.name] = value if spec.wire is None else spec.wire(value)
        return out

    def plan_note(self, epsilon: float, delta: float) -> str:
        """Return what ``--plan`` says about how the budget was divided ("" for nothing)."""
        del epsilon, delta
        return ""

    def mode_errors(self, epsilon: float, delta: float, schema: Schema, n_sites: int,
                    pooled_factor: float) -> tuple[float, float] | str | None:
        """Return the job's expected error ``(site level, secure)`` for ``--plan``, or why not.

        ``n_sites`` independent draws at site level; a secure sum's ``pooled_factor`` times
        its calibrated variance. None (the default): the pooled sums' noise ratio says it
        (:func:`dpfed.common.jobs.modes.compare_modes`).
        """
        del epsilon, delta, schema, n_sites, pooled_factor
        return None

    def aggregation_mode(self) -> Aggregation:
        """How the job's sums travel (kinds without a secure mode: site level)."""
        return Aggregation.SITE

    @property
    def secure(self) -> bool:
        """Whether the job's sums travel as secure sums."""
        return self.aggregation_mode() is Aggregation.SECURE

    @property
    def zcdp(self) -> bool:
        """Return whether the job's rounds compose in zCDP (default: basic composition).

        Each round then gets a share of the job's rho; its secure sums are planned to spend
        at most that share.
        """
        return False

    def required_accountant(self, epsilon: float, delta: float) -> tuple[str, str] | None:
        """Return the accountant a site's ledger must use to take part, and why (default: any)."""
        del epsilon, delta
        return None

    def shares(self, epsilon: float, delta: float) -> list[RoundShare]:
        """Return the job's rounds in order with what each task carries."""
        raise NotImplementedError

    def check_privacy(self, epsilon: float, delta: float) -> None:
        """Raise ValidationError if some round cannot be calibrated at its share (default: ok)."""
        del epsilon, delta


# --------------------------------------------------------------------------- field parsers


def choice(name: str, choices: tuple[str, ...]) -> Parser:
    """Parse one of ``choices`` (the error names the parameter and the valid values)."""
    from dpfed.common.validation import check_choice

    return lambda value, _ctx: check_choice(value, name, choices)


def integer(name: str, *, minimum: int | None = None, maximum: int | None = None) -> Parser:
    """Parse an integer in ``[minimum, maximum]``."""
    from dpfed.common.validation import check_int

    return lambda value, _ctx: check_int(value, name, minimum=minimum, maximum=maximum)
