"""Hypothesis strategies for the JSON values a JSON schema (the OpenAPI components FastAPI writes from pydantic)
admits: `$ref`, `anyOf` / `oneOf`, `enum`, `const`, the six types with their bounds (minimum / maximum and
their exclusive forms, lengths, item counts), required and optional properties, free-form objects. Enough for
the request schemas here; a keyword it does not know fails loudly rather than being ignored."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

KNOWN = {"$ref", "anyOf", "oneOf", "enum", "const", "type", "properties", "required", "additionalProperties",
         "items", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
         "minItems", "maxItems", "minProperties", "maxProperties", "default", "title", "description",
         "discriminator", "format", "examples"}
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10, 10), st.text(max_size=6))
FREE = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                    max_leaves=6)


def from_schema(schema: dict, components: dict[str, dict]) -> st.SearchStrategy[Any]:
    unknown = set(schema) - KNOWN
    if unknown:
        raise ValueError(f"schema keywords this generator does not know: {sorted(unknown)}")
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(components[name], components))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, components) for s in schema[key]])
    kind = schema.get("type")
    if kind is None:
        return FREE
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, components) for k in kind])
    return _TYPED[kind](schema, components)


def _integer(s: dict, _) -> st.SearchStrategy[int]:
    lo = s.get("minimum", s["exclusiveMinimum"] + 1 if "exclusiveMinimum" in s else None)
    hi = s.get("maximum", s["exclusiveMaximum"] - 1 if "exclusiveMaximum" in s else None)
    lo, hi = (None if lo is None else int(lo)), (None if hi is None else int(hi))
    near_lo = -3 if lo is None else lo
    near_hi = near_lo + 64 if hi is None else min(hi, near_lo + 64)
    return st.one_of(st.integers(near_lo, near_hi), st.integers(lo, hi))  # mostly small, now and then extremes


def _number(s: dict, _) -> st.SearchStrategy[float]:
    lo = s.get("minimum", s.get("exclusiveMinimum"))
    hi = s.get("maximum", s.get("exclusiveMaximum"))
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, exclude_min="exclusiveMinimum" in s,
                     exclude_max="exclusiveMaximum" in s)


def _string(s: dict, _) -> st.SearchStrategy[str]:
    size = dict(min_size=s.get("minLength", 0), max_size=min(s.get("maxLength", 24), 24))
    # now and then a lone surrogate, which JSON's \u escapes can carry and no tokenizer takes
    return st.one_of(st.text(**size), st.text(st.characters(categories=["Cs", "Ll"]), **size))


def _array(s: dict, components) -> st.SearchStrategy[list]:
    items = from_schema(s.get("items", {}), components)
    return st.lists(items, min_size=s.get("minItems", 0), max_size=min(s.get("maxItems", 3), 3))


def _object(s: dict, components) -> st.SearchStrategy[dict]:
    props = s.get("properties")
    if not props:
        extra = s.get("additionalProperties", True)
        values = FREE if extra is True else from_schema(extra, components)
        return st.dictionaries(st.text(max_size=6), values, min_size=s.get("minProperties", 0),
                               max_size=min(s.get("maxProperties", 3), 3))
    required = set(s.get("required", ()))

    @st.composite
    def build(draw):
        out = {}
        for name, sub in props.items():
            if name in required or draw(st.booleans()):
                out[name] = draw(from_schema(sub, components))
        return out

    return build()


_TYPED = {"integer": _integer, "number": _number, "string": _string, "boolean": lambda s, c: st.booleans(),
          "null": lambda s, c: st.none(), "array": _array, "object": _object}
