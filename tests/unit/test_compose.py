"""infra/docker-compose.yml never falls back to a known API token: without CRUCIBLE_API_TOKEN
(in the environment or infra/.env) `docker compose` refuses to start, naming the variable."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "infra" / "docker-compose.yml"


def _token_references(text: str) -> list[str]:
    return re.findall(r"\$\{CRUCIBLE_API_TOKEN[^}]*\}", text)


def test_compose_requires_an_api_token_and_has_no_default():
    text = COMPOSE.read_text()
    compose = yaml.safe_load(text)
    environments = [service.get("environment", {}) for service in compose["services"].values()]
    tokens = [env["CRUCIBLE_API_TOKEN"] for env in environments if "CRUCIBLE_API_TOKEN" in env]
    assert {"api", "worker"} <= {name for name, service in compose["services"].items()
                                 if "CRUCIBLE_API_TOKEN" in service.get("environment", {})}
    references = _token_references(text)
    assert references and set(tokens) <= set(references)
    for reference in references:
        # ${VAR:?message}: compose stops with the message when VAR is unset or empty
        assert reference.startswith("${CRUCIBLE_API_TOKEN:?"), reference
        assert "CRUCIBLE_API_TOKEN" in reference[len("${CRUCIBLE_API_TOKEN:?"):]
    assert "change-me" not in text
