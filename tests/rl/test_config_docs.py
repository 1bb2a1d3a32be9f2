"""README promises a docstring for every config field: each field of each config dataclass in
rl/config/schema.py is followed by a string literal (the attribute-docstring convention)."""
import ast
import dataclasses
import inspect

import rl.config.schema
from rl.config import Config


def field_docs() -> dict[str, dict[str, str | None]]:
    """{class name: {field: its docstring or None}} for every class in rl/config/schema.py."""
    tree = ast.parse(inspect.getsource(rl.config.schema))
    out = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        docs = {}
        for st, nxt in zip(cls.body, cls.body[1:] + [None]):
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                is_doc = (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                          and isinstance(nxt.value.value, str))
                docs[st.target.id] = nxt.value.value.strip() if is_doc else None
        out[cls.name] = docs
    return out


def config_classes(cls=Config, seen=None) -> set[type]:
    """Config and every dataclass reachable from its fields."""
    seen = set() if seen is None else seen
    seen.add(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default) and type(default) not in seen:
            config_classes(type(default), seen)
    return seen


def test_every_config_field_has_a_docstring():
    docs = field_docs()
    classes = config_classes()
    assert len(classes) >= 15  # the walk reached the nested sections
    missing = [f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c)
               if not docs.get(c.__name__, {}).get(f.name)]
    assert not missing, f"config fields without a docstring: {sorted(missing)}"
