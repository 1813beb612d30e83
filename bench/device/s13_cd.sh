#!/usr/bin/env bash
# s13_c.sh then s13_d.sh in one lease (~8 minutes).
bash "$(dirname "$0")/s13_c.sh"
bash "$(dirname "$0")/s13_d.sh"
