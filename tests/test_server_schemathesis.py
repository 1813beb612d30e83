"""schemathesis over the server's OpenAPI schema (/openapi.json, with the request bodies of
metrale/server/openapi_bodies.py): generated requests to every POST route never get a 5xx, and
the server answers a normal request afterwards."""
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from fake_model import fake_engine
from metrale.server import ServerThread, create_app


@pytest.fixture(scope="module")
def srv():
    engine = fake_engine(num_blocks=512, **{"scheduler.max_num_seqs": 16})
    with ServerThread(create_app(engine)) as s:
        yield s


def test_generated_requests_never_5xx(srv):
    """Each POST operation of the schema: 25 generated bodies (schemathesis' strategies, run by
    hypothesis here: its pytest plugin does not load under this pytest)."""
    api = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    ops = [result.ok() for result in api.get_all_operations()]
    posts = [op for op in ops if op.method.upper() == "POST"]
    assert len(posts) == 6
    for op in posts:
        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case):
            if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
                case.body["max_tokens"] = min(case.body["max_tokens"], 8)     # keep generations short
            response = case.call(base_url=srv.url, timeout=30)
            assert response.status_code < 500, (op.path, case.body, response.text[:300])
            assert "Traceback" not in response.text
        check()


def test_answers_after_schemathesis(srv):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
