"""What a request's output must match (vLLM's `structured_outputs`): validated on construction,
with a stable cache key, and turned into the grammar text llguidance compiles."""

from __future__ import annotations

import json as jsonlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

from roseinfer import grammar_limits
from roseinfer.errors import InvalidRequestError

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_JSON_KINDS = frozenset({"json", "json_object"})
# vLLM fields this implementation does not offer: a request naming one gets a clear 400.
_UNSUPPORTED_FIELDS = ("disable_fallback", "disable_additional_properties", "structural_tag")
# What `json_object` means: any JSON object.
_ANY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


@dataclass
class StructuredOutputsParams:
    """Exactly one of `json` (a JSON Schema, as a dict or its JSON text), `regex`, `choice` (the
    output is one of these strings), `grammar` (Lark, or llama.cpp's GBNF) or `json_object=True`
    (any JSON object).

    For the JSON kinds, `disable_any_whitespace` allows no whitespace between tokens of the JSON
    and `whitespace_pattern` (a regex) replaces the default whitespace pattern.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    # The schema as a dict, parsed once from `json` (or the any-object schema).
    _schema: dict[str, Any] | None = field(init=False, repr=False, compare=False, default=None)
    # Set once `validate` passed: the prompts of one request share this object and its check.
    _validated: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        chosen = [kind for kind in _KINDS if self._is_set(kind)]
        if len(chosen) != 1:
            given = ", ".join(chosen) or "none"
            raise InvalidRequestError(
                f"structured_outputs needs exactly one of {', '.join(_KINDS)} (got: {given})",
                param="structured_outputs",
            )
        self.kind: str = chosen[0]
        self.param: str = f"structured_outputs.{self.kind}"
        getattr(self, f"_check_{self.kind}")()
        self._check_whitespace_options()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StructuredOutputsParams:
        """From a request body's `structured_outputs` object; unknown keys are a 400 naming them."""
        if not isinstance(data, Mapping):
            raise InvalidRequestError(
                "structured_outputs must be an object", param="structured_outputs"
            )
        known = {*_KINDS, "disable_any_whitespace", "whitespace_pattern"}
        for key in data:
            if key in _UNSUPPORTED_FIELDS:
                raise InvalidRequestError(
                    f"structured_outputs.{key} is not supported", param=f"structured_outputs.{key}"
                )
            if key not in known:
                raise InvalidRequestError(
                    f"unknown field structured_outputs.{key} (known: {', '.join(sorted(known))})",
                    param=f"structured_outputs.{key}",
                )
        return cls(**data)

    # -- what it becomes ---------------------------------------------------------------------------

    @cached_property
    def cache_key(self) -> str:
        """The same for two requests that ask for the same grammar, across processes and runs."""
        if self.kind in _JSON_KINDS:
            # Key order is kept: it is the order the properties are generated in.
            body = _dump(self._schema)
            options = _dump([self.disable_any_whitespace, self.whitespace_pattern])
            return f"json:{options}:{body}"
        if self.kind == "choice":
            return f"choice:{_dump(self.choice)}"
        return f"{self.kind}:{getattr(self, self.kind)}"

    @cached_property
    def grammar_text(self) -> str:
        """The grammar as llguidance's LLMatcher takes it (not yet checked: see `validate`).
        What llguidance refuses to convert (an integer past 64 bits in a schema, a GBNF syntax
        error) is a 400 naming the field, as what `validate` finds is."""
        try:
            if self.kind in _JSON_KINDS:
                grammar_limits.check_json_schema(self._schema, self.param)
                return llguidance.LLMatcher.grammar_from_json_schema(
                    self._schema, overrides=self._json_options() or None
                )
            if self.kind != "grammar":
                return llguidance.grammar_from(self.kind, getattr(self, self.kind))
            # Lark as it is; GBNF through llguidance's own converter. Limits first: grammar_limits.py.
            lark = self.grammar
            if not is_lark_syntax(lark):
                grammar_limits.check_gbnf(lark, self.param)
                try:
                    lark = gbnf_to_lark(lark)
                except Exception as exc:  # as llguidance.grammar_from words it
                    raise ValueError(f"Failed to convert the grammar from GBNF to Lark: {exc}") from exc
            grammar_limits.check_lark(lark, self.param)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        except InvalidRequestError:
            raise
        except ValueError as exc:
            raise InvalidRequestError(f"invalid {self.param}: {exc}", param=self.param) from exc

    def _json_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.disable_any_whitespace:
            options["whitespace_flexible"] = False
        if self.whitespace_pattern is not None:
            options["whitespace_pattern"] = self.whitespace_pattern
        return options

    def validate(self) -> None:
        """llguidance's own check of the grammar (schema features, regex syntax, Lark rules),
        without a tokenizer: fast enough to run before a request is queued. Run once per object
        (the prompts of one request share it); a failure is raised again each time."""
        if self._validated:
            return
        error = llguidance.LLMatcher.validate_grammar(self.grammar_text)
        if error:
            raise InvalidRequestError(f"invalid {self.param}: {error.strip()}", param=self.param)
        self._validated = True

    # -- checks ------------------------------------------------------------------------------------

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return bool(value) if kind == "json_object" else value is not None

    def _check_json(self) -> None:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = jsonlib.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(
                    f"structured_outputs.json is not valid JSON: {exc}", param=self.param
                ) from exc
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                "structured_outputs.json must be a JSON Schema object, "
                f"got {type(schema).__name__}",
                param=self.param,
            )
        self._schema = schema

    def _check_json_object(self) -> None:
        if self.json_object is not True:
            raise InvalidRequestError(
                f"structured_outputs.json_object must be true, got {self.json_object!r}",
                param=self.param,
            )
        self._schema = _ANY_OBJECT_SCHEMA

    def _check_regex(self) -> None:
        self._check_text(self.regex)

    def _check_grammar(self) -> None:
        self._check_text(self.grammar)

    def _check_text(self, value: Any) -> None:
        if not isinstance(value, str) or not value.strip():
            raise InvalidRequestError(f"{self.param} must be a non-empty string", param=self.param)

    def _check_choice(self) -> None:
        choice = self.choice
        if not isinstance(choice, list | tuple) or not choice:
            raise InvalidRequestError(
                "structured_outputs.choice must be a non-empty list of strings", param=self.param
            )
        for i, option in enumerate(choice):
            if not isinstance(option, str) or not option:
                raise InvalidRequestError(
                    f"structured_outputs.choice[{i}] must be a non-empty string, got {option!r}",
                    param=self.param,
                )
        self.choice = list(choice)

    def _check_whitespace_options(self) -> None:
        for name in ("disable_any_whitespace", "whitespace_pattern"):
            value = getattr(self, name)
            if value in (None, False):
                continue
            param = f"structured_outputs.{name}"
            if self.kind not in _JSON_KINDS:
                raise InvalidRequestError(
                    f"{param} applies to json and json_object only, not {self.kind}", param=param
                )
            if name == "disable_any_whitespace" and value is not True:
                raise InvalidRequestError(f"{param} must be a boolean, got {value!r}", param=param)
            if name == "whitespace_pattern" and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{param} must be a non-empty regex", param=param)
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise InvalidRequestError(
                "structured_outputs.whitespace_pattern cannot be combined with "
                "disable_any_whitespace",
                param="structured_outputs.whitespace_pattern",
            )


def _dump(value: Any) -> str:
    return jsonlib.dumps(value, ensure_ascii=False, separators=(",", ":"))
