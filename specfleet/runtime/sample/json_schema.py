"""Which parts of a JSON Schema structured output enforces, and the schema the grammar engine is given.

JSON Schema is open: a keyword a validator does not know is an annotation (it constrains nothing), and
`format` is an annotation unless a validator chooses to assert it. A schema taken from an API
description (OpenAPI, JSON Schema Store, a tool's `parameters`) often carries such keywords
(`discriminator`, `x-order`, `"format": "semver"`), so every keyword of a schema falls in one of:

- enforced: the grammar engine (llguidance) makes every output satisfy it; this includes keywords this
  module rewrites into ones llguidance implements with the same meaning (`dependentRequired`,
  `dependentSchemas`, `if` + `else`, `not` of a type, `unevaluatedProperties` beside no applicator, ...)
  and the formats it or this module can write a grammar for;
- narrowed: enforced by generating a subset of what the keyword allows, so every output is still valid
  (`if` + `then`: only values the `if` and the `then` accept; `contains`: the first items are the ones
  that match; `uniqueItems`: at most one item);
- an annotation: it cannot make a value invalid (`title`, `description`, `default`, `examples`, ...), or
  it is unknown (any other keyword, any format without a grammar here): accepted, not enforced, logged
  once per name and listed in the request's notes (the server counts them in /metrics);
- not enforceable: an assertion the grammar engine cannot enforce, where ignoring it could return JSON
  the schema rejects (`uniqueItems` with more than one item, `not` of anything but types,
  `unevaluatedProperties` beside `allOf`, a `oneOf` whose branches may overlap, ...). By default the
  schema is refused (`UnenforceableSchemaError`, a 400 naming the keyword and where it is); with
  `relaxed` the output is generated under the rest of the schema and the keyword is listed as
  `not_enforced` in the request's notes. `relaxed` also drops (and lists) keywords llguidance
  implements but cannot compile for the schema at hand (`_LIMITS`: a pattern outside its regex syntax,
  overlapping patternProperties, bounds beyond its number ranges), which are a 400 otherwise.

Every rewrite is checked against `jsonschema` on instances (tests/runtime/sample/test_json_schema.py), and on the
official JSON-Schema-Test-Suite by benchmarks/peers/schema_coverage.py.

docs/compatibility.md has the table, keyword by keyword.
"""
from __future__ import annotations

import copy
import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from specfleet.errors import InvalidRequestError

logger = logging.getLogger("specfleet.grammar")

# keywords llguidance implements (its docs/json_schema.md), kept as they are
ENFORCED = frozenset({
    "type", "enum", "const", "properties", "additionalProperties", "required", "patternProperties",
    "items", "prefixItems", "additionalItems", "minItems", "maxItems", "minLength", "maxLength", "pattern",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf",
    "$ref", "$defs", "definitions", "minProperties", "maxProperties", "format",
})
# keywords JSON Schema defines that never make a value invalid
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "$schema", "$id", "id", "$anchor",
    "$dynamicAnchor", "$recursiveAnchor", "deprecated", "readOnly", "writeOnly", "contentEncoding",
    "contentMediaType", "contentSchema", "$vocabulary", "x-guidance",
})
# assertions this module rewrites, narrows or (when it cannot) refuses
REWRITTEN = frozenset({
    "uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else", "dependentRequired",
    "dependentSchemas", "dependencies", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
    "$dynamicRef", "$recursiveRef",
})
# formats llguidance writes a grammar for
ENGINE_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6",
                            "uuid", "uri"})
# formats this module turns into a pattern or bounds
_SEGMENT = r"(?:[^~/]|~[01])*"
PATTERN_FORMATS = {
    "json-pointer": rf"^(?:/{_SEGMENT})*$",
    "relative-json-pointer": rf"^(?:0|[1-9][0-9]*)(?:#|(?:/{_SEGMENT})*)$",
}
# (int64's bounds are beyond the engine's number ranges: an annotation, like other OpenAPI formats)
BOUND_FORMATS = {"int32": (-2**31, 2**31 - 1), "uint32": (0, 2**32 - 1)}
KNOWN_FORMATS = ENGINE_FORMATS | set(PATTERN_FORMATS) | set(BOUND_FORMATS)

_TYPES = ("null", "boolean", "object", "array", "number", "string")  # integer is part of number
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
            "propertyNames", "unevaluatedProperties", "unevaluatedItems", "contentSchema")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")
# keywords that evaluate properties / items of the same instance (unevaluated* looks through them)
_IN_PLACE = ("allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "$recursiveRef", "if", "then", "else",
             "dependentSchemas", "dependencies", "not")


# -- the closing policy (objects list their keys) -------------------------------------------------
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "additionalItems", "unevaluatedItems")
# keywords beside `properties` whose subschemas list properties of the same object: closing the object
# would forbid those
_MERGED = ("allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "then", "else", "dependentSchemas",
           "dependencies")


def _mixin_refs(schema: Any, found: set[str]) -> set[str]:
    """Local `$ref`s whose target is merged into another object schema (an `allOf` member, or a `$ref`
    beside `properties`): closing such a target would forbid the other schema's properties."""
    if isinstance(schema, dict):
        members = schema.get("allOf") if isinstance(schema.get("allOf"), list) else []
        for m in members:
            if isinstance(m, dict) and isinstance(m.get("$ref"), str):
                found.add(m["$ref"])
        if isinstance(schema.get("$ref"), str) and any(k in schema for k in ("properties", "allOf")):
            found.add(schema["$ref"])
        for v in schema.values():
            _mixin_refs(v, found)
    elif isinstance(schema, list):
        for v in schema:
            _mixin_refs(v, found)
    return found


def close_objects(schema: Any, _mixins: set[str] | None = None, _where: str = "#") -> Any:
    """A copy of a JSON schema in which an object schema that lists `properties` and says nothing of
    others allows no others, as vLLM's default engine does (xgrammar's strict mode): without it a small
    model invents keys until max_tokens. `additionalProperties: true` (or a schema) keeps them allowed.
    Only schemas a value is generated from are closed: not an object whose properties are also listed by
    its `allOf` / `anyOf` / `$ref` / `if` ... (closing it would forbid those), nor the schemas inside
    those, `not` and `contains` (they describe part of a value, or a value's other side), nor a `$defs`
    entry that is merged into another object (`allOf: [{"$ref": ...}]`)."""
    if not isinstance(schema, dict):
        return schema
    mixins = _mixin_refs(schema, set()) if _mixins is None else _mixins
    out = dict(schema)
    if "properties" in out and _where not in mixins and not any(
            k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties", *_MERGED)):
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub, mixins, f"{_where}/{key}/{name}") for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(sub, mixins, f"{_where}/{key}/{i}") for i, sub in enumerate(out[key])]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            value = out[key]
            out[key] = ([close_objects(v, mixins, f"{_where}/{key}/{i}") for i, v in enumerate(value)]
                        if isinstance(value, list) else close_objects(value, mixins, f"{_where}/{key}"))
    return out


class UnenforceableSchemaError(InvalidRequestError):
    """A schema keyword the grammar engine cannot enforce, where ignoring it could return JSON the schema
    rejects (a 400). `keyword` names it, `where` is its JSON pointer in the schema."""

    def __init__(self, keyword: str, where: str | None, why: str):
        self.keyword, self.where = keyword, where
        at = "" if where is None else f" at #{where}"
        super().__init__(f"the JSON schema's {keyword!r}{at} cannot be enforced by the grammar "
                         f"engine ({why}), and ignoring it could return JSON the schema rejects; give "
                         f"strict=false (response_format.json_schema.strict, or the server's "
                         f"--unenforceable-schema relax) to generate under the rest of the schema")


@dataclass(frozen=True)
class Note:
    keyword: str  # the keyword (for a format: "format:NAME")
    where: str | None  # JSON pointer of the schema object that has it (None: the engine did not say)
    detail: str = ""

    def text(self) -> str:
        at = "" if self.where is None else f" at #{self.where}"
        return f"{self.keyword}{at}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class SchemaNotes:
    """What a schema asked that is not fully enforced."""

    annotations: list[Note] = field(default_factory=list)  # unknown keywords, formats without a grammar
    narrowed: list[Note] = field(default_factory=list)  # enforced on a subset of the valid values
    not_enforced: list[Note] = field(default_factory=list)  # relaxed: generated without them

    def __bool__(self) -> bool:
        return bool(self.annotations or self.narrowed or self.not_enforced)

    def as_dict(self) -> dict[str, list[str]]:
        """{"annotations": [...], "narrowed": [...], "not_enforced": [...]}, the non-empty ones."""
        return {k: [n.text() for n in getattr(self, k)] for k in ("annotations", "narrowed", "not_enforced")
                if getattr(self, k)}


_SEEN: set[str] = set()  # names logged once per process
_SEEN_LOCK = threading.Lock()
MAX_LOGGED_NAMES = 256


def _log_once(kind: str, name: str, message: str) -> None:
    key = f"{kind}:{name}"
    with _SEEN_LOCK:
        if key in _SEEN or len(_SEEN) >= MAX_LOGGED_NAMES:
            return
        _SEEN.add(key)
    logger.warning(message)


def _ptr(where: str, *parts: Any) -> str:
    for p in parts:
        where += "/" + str(p).replace("~", "~0").replace("/", "~1")
    return where


class _Planner:
    def __init__(self, relaxed: bool, root: Any):
        self.relaxed = relaxed
        self.root = root
        self.notes = SchemaNotes()
        self.dynamic_anchors: dict[str, int] = {}
        self._count_dynamic_anchors(root)

    def _count_dynamic_anchors(self, node: Any) -> None:
        if isinstance(node, dict):
            name = node.get("$dynamicAnchor")
            if isinstance(name, str):
                self.dynamic_anchors[name] = self.dynamic_anchors.get(name, 0) + 1
            for v in node.values():
                self._count_dynamic_anchors(v)
        elif isinstance(node, list):
            for v in node:
                self._count_dynamic_anchors(v)

    # -- outcomes ----------------------------------------------------------------------------------
    def unenforceable(self, node: dict, keyword: str, where: str | None, why: str, drop: tuple[str, ...] = ()) -> None:
        """Refuse, or (relaxed) drop `keyword` (and `drop`) from `node` and note it."""
        if not self.relaxed:
            raise UnenforceableSchemaError(keyword, where, why)
        for k in (keyword, *drop):
            node.pop(k, None)
        self.notes.not_enforced.append(Note(keyword, where, why))
        _log_once("not_enforced", keyword, f"JSON schema keyword {keyword!r} is not enforced (relaxed: "
                                           f"generating under the rest of the schema): {why}")

    def narrowed(self, keyword: str, where: str, how: str) -> None:
        self.notes.narrowed.append(Note(keyword, where, how))
        _log_once("narrowed", keyword, f"JSON schema keyword {keyword!r} is enforced by narrowing: {how}")

    def annotation(self, keyword: str, where: str, detail: str = "") -> None:
        self.notes.annotations.append(Note(keyword, where, detail))
        kind = "format" if keyword.startswith("format:") else "keyword"
        _log_once(kind, keyword, f"JSON schema {kind} {keyword.split(':', 1)[-1]!r} is not enforced "
                                 f"(accepted as an annotation; counted in specfleet_json_schema_keywords_total)")

    # -- the walk ----------------------------------------------------------------------------------
    def schema(self, node: Any, where: str) -> Any:
        if not isinstance(node, dict):
            return node  # true / false (a list or other value is not a schema: the engine says so)
        out = dict(node)
        for key in _SCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {k: self.schema(v, _ptr(where, key, k)) for k, v in out[key].items()}
        for key in _SCHEMA_LISTS:
            if isinstance(out.get(key), list):
                out[key] = [self.schema(v, _ptr(where, key, i)) for i, v in enumerate(out[key])]
        for key in _SCHEMAS:
            if key in out:
                out[key] = self.schema(out[key], _ptr(where, key))
        if isinstance(out.get("items"), list):
            out["items"] = [self.schema(v, _ptr(where, "items", i)) for i, v in enumerate(out["items"])]
        elif "items" in out:
            out["items"] = self.schema(out["items"], _ptr(where, "items"))
        if isinstance(out.get("dependencies"), dict):
            out["dependencies"] = {k: v if isinstance(v, list) else self.schema(v, _ptr(where, "dependencies", k))
                                   for k, v in out["dependencies"].items()}
        for key in _COUNTS:  # 2.0 is a valid count (JSON Schema compares numbers by value)
            v = out.get(key)
            if isinstance(v, float) and v.is_integer() and v >= 0:
                out[key] = int(v)
        self._keywords(out, where)
        return out

    def _keywords(self, s: dict, where: str) -> None:
        # annotations and unknown keywords first (they constrain nothing)
        for key in list(s):
            if key not in ENFORCED and key not in ANNOTATIONS and key not in REWRITTEN:
                self.annotation(key, where)
        if "$dynamicAnchor" in s:  # llguidance resolves plain anchors only
            name = s.pop("$dynamicAnchor")
            s.setdefault("$anchor", name)
        s.pop("$recursiveAnchor", None)
        self._format(s, where)
        # unevaluated* before the rewrites below add applicators of their own
        self._unevaluated(s, where)
        self._dynamic_ref(s, where)
        self._dependencies(s, where)
        self._conditional(s, where)
        self._not(s, where)
        self._property_names(s, where)
        self._contains(s, where)
        self._unique(s, where)

    def _format(self, s: dict, where: str) -> None:
        fmt = s.get("format")
        if fmt is None:
            return
        if not isinstance(fmt, str):
            raise InvalidRequestError(f"the JSON schema's 'format' at #{where} must be a string, got "
                                      f"{type(fmt).__name__}")
        if fmt in ENGINE_FORMATS:
            return
        del s["format"]
        if fmt in PATTERN_FORMATS:
            self._add(s, {"pattern": PATTERN_FORMATS[fmt]})
        elif fmt in BOUND_FORMATS:
            lo, hi = BOUND_FORMATS[fmt]
            self._add(s, {"minimum": lo, "maximum": hi})
        else:
            self.annotation(f"format:{fmt}", where)

    @staticmethod
    def _add(s: dict, sub: Any) -> None:
        """Intersect `s` with `sub` (llguidance intersects sibling keywords with allOf's members)."""
        all_of = s.get("allOf")
        s["allOf"] = [*(all_of if isinstance(all_of, list) else []), sub]

    def _resolve(self, ref: Any) -> Any:
        """The target of a local `$ref` ("#/$defs/x") in the original schema, or None."""
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return None
        node = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def _always_evaluated(self, s: Any, depth: int = 0) -> list | None:
        """The schemas whose properties / items always count as evaluated for a value `s` accepts: `s`
        and, through `allOf` and local `$ref`s, the schemas it is the intersection of. None when some
        evaluation depends on which branch a value takes (anyOf, oneOf, if, ...): no exact grammar."""
        if not isinstance(s, dict):
            return []
        if depth > 16 or any(k in s for k in _IN_PLACE if k not in ("allOf", "$ref")):
            return None
        found = [s]
        members = list(s.get("allOf") or []) if isinstance(s.get("allOf", []), list) else None
        if members is None:
            return None
        if "$ref" in s:
            target = self._resolve(s["$ref"])
            if target is None:
                return None
            members.append(target)
        for m in members:
            more = self._always_evaluated(m, depth + 1)
            if more is None:
                return None
            found += more
        return found

    def _unevaluated(self, s: dict, where: str) -> None:
        in_place = [k for k in _IN_PLACE if k in s]
        if "unevaluatedProperties" in s:
            up = s.pop("unevaluatedProperties")
            parts = self._always_evaluated(s) if up is not True and up != {} else []
            if parts is None or any("patternProperties" in p for p in parts[1:]):
                s["unevaluatedProperties"] = up
                self.unenforceable(s, "unevaluatedProperties", where,
                                   f"beside {in_place[0]!r}, which evaluates properties only for some values")
            elif not any("additionalProperties" in p for p in parts):
                # the properties allOf / $ref name are evaluated: listed here (as `true`), the rest is additional
                own = dict(s.get("properties") or {})
                s["properties"] = {**own, **{n: True for p in parts[1:] for n in (p.get("properties") or {})
                                             if n not in own}}
                s["additionalProperties"] = up
        if "unevaluatedItems" in s:
            ui = s.pop("unevaluatedItems")
            parts = self._always_evaluated(s) if ui is not True and ui != {} else []
            if parts is None or "contains" in s or any(isinstance(p.get("items"), list) for p in parts[1:]):
                s["unevaluatedItems"] = ui
                self.unenforceable(s, "unevaluatedItems", where,
                                   f"beside {(in_place or ['contains'])[0]!r}, which evaluates items only "
                                   f"for some values")
            elif isinstance(s.get("items"), list):
                s.setdefault("additionalItems", ui)
            elif not any("items" in p for p in parts):
                # the first n items are evaluated (the longest prefixItems), the rest are unevaluated items
                n = max((len(p.get("prefixItems") or []) for p in parts), default=0)
                prefix = list(s.get("prefixItems") or [])
                s["prefixItems"] = prefix + [True] * (n - len(prefix))
                s["items"] = ui

    def _dynamic_ref(self, s: dict, where: str) -> None:
        for key in ("$dynamicRef", "$recursiveRef"):
            if key not in s:
                continue
            ref = s[key]
            name = ref[1:] if isinstance(ref, str) and ref.startswith("#") else None
            if key == "$dynamicRef" and name is not None and "$ref" not in s and (
                    name.startswith("/") or self.dynamic_anchors.get(name, 0) <= 1):
                # one anchor of that name (or a plain pointer): the dynamic scope cannot change the target
                s["$ref"] = s.pop(key)
            else:
                self.unenforceable(s, key, where, "dynamic references that depend on the evaluation path")

    def _dependencies(self, s: dict, where: str) -> None:
        req = dict(s.pop("dependentRequired", None) or {})
        dep_schemas = dict(s.pop("dependentSchemas", None) or {})
        for name, v in (s.pop("dependencies", None) or {}).items():  # drafts 4-7: both in one keyword
            (req if isinstance(v, list) else dep_schemas)[name] = v
        # "a present => b present" as "a absent, or a and b present" (a property schema `false` forbids it)
        for name, needs in req.items():
            if needs:
                self._add(s, {"anyOf": [{"properties": {name: False}}, {"required": [name, *needs]}]})
        for name, sub in dep_schemas.items():
            if sub is True or sub == {}:
                continue
            self._add(s, {"anyOf": [{"properties": {name: False}}, {"allOf": [{"required": [name]}, sub]}]})

    def _conditional(self, s: dict, where: str) -> None:
        cond, then, other = s.pop("if", None), s.pop("then", None), s.pop("else", None)
        if cond is None or (then is None and other is None):
            return  # then/else without if, or if alone: they assert nothing
        if cond is True or cond == {}:
            if then is not None:
                self._add(s, then)
        elif cond is False:
            if other is not None:
                self._add(s, other)
        elif then is None:  # (if) or (not if and else) == if or else
            self._add(s, {"anyOf": [cond, other]})
        else:
            # (if and then) or (not if and else): "not if" has no grammar, so only the first branch is generated
            self._add(s, {"allOf": [cond, then]})
            self.narrowed("if", where, "only values that match 'if' and 'then' are generated")

    def _not(self, s: dict, where: str) -> None:
        if "not" not in s:
            return
        sub = s["not"]
        if sub is False:
            del s["not"]
            return
        if sub is True or sub == {}:
            del s["not"]
            self._add(s, False)
            return
        if isinstance(sub, dict) and set(sub) - ANNOTATIONS == {"type"}:
            t = sub["type"]
            types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
            if types is not None and types <= {*_TYPES, "integer"}:
                allowed = [x for x in _TYPES if x not in types]
                if "integer" in types and "number" not in types:
                    # a number that is not an integer has no grammar here: numbers are left out altogether
                    allowed.remove("number")
                    self.narrowed("not", where, "no numbers are generated (non-integer numbers have no grammar)")
                del s["not"]
                self._add(s, {"type": allowed} if allowed else False)
                return
        self.unenforceable(s, "not", where, "the grammar engine cannot negate this schema")

    def _property_names(self, s: dict, where: str) -> None:
        if "propertyNames" not in s:
            return
        pn = s["propertyNames"]
        if pn is True or pn == {}:
            del s["propertyNames"]
            return
        if pn is False:
            del s["propertyNames"]
            s["properties"] = {k: False for k in (s.get("properties") or {})}
            s.pop("patternProperties", None)
            s["additionalProperties"] = False
            return
        regex = _name_regex(pn) if isinstance(pn, dict) else None
        if regex is None or "patternProperties" in s:
            self.unenforceable(s, "propertyNames", where, "only a pattern, a length or an enum of names, "
                                                          "without patternProperties, can be enforced")
            return
        del s["propertyNames"]
        props = s.get("properties")
        if isinstance(props, dict):
            s["properties"] = {k: (v if re.search(regex, k) else False) for k, v in props.items()}
        extra = s.get("additionalProperties", False if isinstance(props, dict) else True)
        if extra is not False and isinstance(props, dict) and props:
            # a pattern property would apply to the listed properties too: no other names are generated
            s["additionalProperties"] = False
            self.narrowed("propertyNames", where, "only the listed properties are generated")
        elif extra is not False:  # other names: only those the pattern allows, as the schema says
            s["patternProperties"] = {regex: extra}
            s["additionalProperties"] = False

    def _contains(self, s: dict, where: str) -> None:
        if "contains" not in s:
            for k in ("minContains", "maxContains"):
                s.pop(k, None)  # without contains they assert nothing
            return
        sub = s["contains"]
        lo, hi = s.get("minContains", 1), s.get("maxContains")
        if not isinstance(lo, int) or (hi is not None and not isinstance(hi, int)):
            raise InvalidRequestError(f"the JSON schema's minContains / maxContains at #{where} must be "
                                      f"non-negative integers")
        max_items = s.get("maxItems")
        if lo == 0 and (hi is None or (isinstance(max_items, int) and hi >= max_items)):
            for k in ("contains", "minContains", "maxContains"):
                s.pop(k, None)
            return
        bounded = hi is not None and not (isinstance(max_items, int) and hi >= max_items)
        if bounded or isinstance(s.get("items"), list):
            self.unenforceable(s, "contains", where, "counting the items that match has no grammar "
                                                      "(maxContains, or items as a list)",
                               drop=("minContains", "maxContains"))
            return
        for k in ("contains", "minContains", "maxContains"):
            s.pop(k, None)
        # the first `lo` items are ones that match (and the items schema); the rest are any items
        item = s.get("items", True)
        prefix = list(s.get("prefixItems") or [])
        for i in range(lo):
            both = {"allOf": [item if i >= len(prefix) else prefix[i], sub]}
            if i < len(prefix):
                prefix[i] = both
            else:
                prefix.append(both)
        s["prefixItems"] = prefix
        s["minItems"] = max(s.get("minItems", 0) if isinstance(s.get("minItems"), int) else 0, lo)
        self.narrowed("contains", where, f"the first {lo} item(s) are the ones that match 'contains'")

    def _unique(self, s: dict, where: str) -> None:
        if "uniqueItems" not in s:
            return
        unique = s.pop("uniqueItems")
        max_items = s.get("maxItems")
        if unique is not True or (isinstance(max_items, int) and max_items <= 1):
            return
        min_items = s.get("minItems", 0)
        if isinstance(min_items, int) and min_items <= 1 and not s.get("prefixItems"):
            s["maxItems"] = 1  # one item is always unique
            self.narrowed("uniqueItems", where, "at most one item is generated")
            return
        s["uniqueItems"] = True
        self.unenforceable(s, "uniqueItems", where, "the grammar cannot compare items with each other")


def _name_regex(pn: dict) -> str | None:
    """A regular expression (llguidance's: Rust `regex`) for the names a propertyNames schema allows, for
    the forms that have one: a pattern, a length, a const or an enum of strings (formats: annotations)."""
    keys = set(pn) - ANNOTATIONS - {"type", "format"}
    if pn.get("type", "string") != "string":
        return None
    if keys == {"pattern"} and isinstance(pn["pattern"], str):
        p = pn["pattern"]
        return p if p.startswith("^") else f"^.*(?:{p})"
    if keys and keys <= {"minLength", "maxLength"}:
        lo, hi = pn.get("minLength", 0), pn.get("maxLength", "")
        if isinstance(lo, int) and (hi == "" or isinstance(hi, int)):
            return f"^.{{{lo},{hi}}}$"
        return None
    values = [pn["const"]] if keys == {"const"} else pn.get("enum") if keys == {"enum"} else None
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return "^(?:" + "|".join(re.escape(v) for v in values) + ")$"
    return None


@dataclass(frozen=True)
class SchemaPlan:
    grammar: str  # the llguidance grammar
    notes: SchemaNotes


_PLANS: "OrderedDict[tuple, SchemaPlan]" = OrderedDict()
_PLANS_LOCK = threading.Lock()
MAX_PLANS = 512


# engine limits on keywords it implements (relaxed: those keywords are dropped wherever they are)
_LIMITS = (("regex parse error", "pattern", ("pattern", "patternProperties"),
            "a pattern outside the engine's regex syntax"),
           ("not disjoint", "patternProperties", ("patternProperties",), "patternProperties whose patterns overlap"),
           ("float range", "minimum/maximum", ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
            "number bounds beyond the engine's range"),
           ("multipleOf", "multipleOf", ("multipleOf",), "a multipleOf with too many digits"),
           ("min/maxProperties only supported", "minProperties/maxProperties", ("minProperties", "maxProperties"),
            "property counts where not every listed property is required"),
           ("JSON serializable", "numbers", ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "const",
                                             "enum"), "numbers beyond the engine's range"))


def _drop_everywhere(node: Any, keys: tuple[str, ...]) -> Any:
    """`node` without `keys` in any schema object (values of `properties` & co. are schemas, so a
    property named like a keyword goes too: a relaxed fallback, noted as such)."""
    if isinstance(node, dict):
        return {k: _drop_everywhere(v, keys) for k, v in node.items() if k not in keys}
    if isinstance(node, list):
        return [_drop_everywhere(v, keys) for v in node]
    return node


def _unimplemented(message: str) -> list[str] | None:
    m = re.search(r"Unimplemented keys: \[([^\]]*)\]", message)
    return [k.strip().strip('"') for k in m.group(1).split(",")] if m else None


def plan(schema: Any, options: dict, relaxed: bool) -> SchemaPlan:
    """The llguidance grammar of a JSON schema (a dict, a bool, or its JSON text) and what of it is not
    fully enforced. `options` are llguidance's JSON options (whitespace). Raises InvalidRequestError for
    a schema that is not valid or admits nothing, UnenforceableSchemaError (unless `relaxed`) for an
    assertion the grammar engine cannot enforce. Cached by the schema's text."""
    from llguidance import LLMatcher

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    if schema is False:
        raise InvalidRequestError("the JSON schema is `false`, which no value satisfies")
    # not sort_keys: the order of `properties` is the order the grammar writes them in
    key = (json.dumps(schema), json.dumps(options, sort_keys=True), relaxed)
    with _PLANS_LOCK:
        found = _PLANS.get(key)
        if found is not None:
            _PLANS.move_to_end(key)
            return found
    planner = _Planner(relaxed, schema)
    # closed first, so that the subschemas the rewrites add (`{"properties": {"a": false}}`) stay open
    rewritten = planner.schema(close_objects(copy.deepcopy(schema if schema is not True else {})), "")
    opts = {**options, "lenient": False}
    for _ in range(3 + len(_LIMITS)):  # as planned, oneOf coerced, unimplemented keys ignored, limits dropped
        try:
            grammar = LLMatcher.grammar_from_json_schema(rewritten, defaults=opts)
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
            error = messages[0].strip().splitlines()[0] if is_error else ""
        except ValueError as e:
            grammar, error = "", str(e).strip().splitlines()[0]
        if not error:
            break
        keys = _unimplemented(error)
        if "coerce_one_of" in error and not opts.get("coerce_one_of"):
            planner.unenforceable({}, "oneOf", None, "its branches may overlap, and the grammar cannot exclude "
                                                   "values that match two of them; relaxed: generated as anyOf")
            opts["coerce_one_of"] = True
        elif keys and not opts["lenient"]:
            for k in keys:
                planner.unenforceable({}, k, None, "the grammar engine does not implement it here")
            opts["lenient"] = True
        elif relaxed and (limit := next((x for x in _LIMITS if x[0] in error), None)) is not None:
            planner.unenforceable({}, limit[1], None, f"{limit[3]}: {error[:120]}")
            rewritten = _drop_everywhere(rewritten, limit[2])
        else:
            raise InvalidRequestError(f"invalid JSON schema: {error}")
    else:
        raise InvalidRequestError(f"invalid JSON schema: {error}")
    result = SchemaPlan(grammar, planner.notes)
    with _PLANS_LOCK:
        _PLANS[key] = result
        while len(_PLANS) > MAX_PLANS:
            _PLANS.popitem(last=False)
    return result
