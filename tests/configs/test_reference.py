"""The configuration reference is the schema's: regenerated, it is byte for byte the file."""

from __future__ import annotations

from configs.reference import REFERENCE_PATH, render, sections, type_text


def test_the_reference_file_is_rendered_from_the_schema():
    assert REFERENCE_PATH.read_text() == render(), "docs/configuration.md is stale: run `make config-docs`"


def test_every_setting_has_a_one_line_description():
    settings = [s for section in sections() for s in section.settings]
    missing = [s.key for s in settings if not s.description.strip() or "\n" in s.description]
    assert not missing, f"settings without a one-line Field(description=...): {missing}"
    assert {
        "router.host_hit_value",
        "replica.stream_interval_s",
        "ingress.max_body_bytes",
        "server.served_model_name",
        "max_model_len",
    } <= {s.key for s in settings}


def test_types_read_as_yaml_words():
    from typing import Literal

    assert type_text(int | None) == "int or null"
    assert type_text(tuple[int, ...]) == "list of int"
    assert type_text(Literal["a", "b"]) == "a | b"
    assert type_text(dict[str, float]) == "map of string to float"
