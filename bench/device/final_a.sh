#!/usr/bin/env bash
# Final device run, call A (carry .whl and .m1): packages into /tmp/site, SmolLM2 part 1 into /tmp/mdl.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --no-build-isolation --target /tmp/site .whl/*.whl .whl/*.tar.gz >/dev/null || exit 1
mkdir -p /tmp/mdl && cp .m1/smolpart.aa /tmp/mdl/ && ls -la /tmp/mdl; which nsys ncu || true
