#!/usr/bin/env bash
# Issue 50: ZB-V's cut, evening the stages of the V against evening the chunks one by one
# (results/pipeline/zero-bubble/v-cut/README.md). The V cut (plan/pipeline/cuts.rs balance_v) was
# commit f01d2ff, reverted after this measurement: --before is a build of 7df3825 (chunks
# evened), --after one of f01d2ff (stages evened). The runs: scripts/measure-zb-v-builds.sh.
#   scripts/measure-zb-v-cut.sh --before PATH --after PATH [--stages 2] [--steps 14] [--reps 2] [--models "resnet18 vit-tiny"]
exec "$(dirname "${BASH_SOURCE[0]}")/measure-zb-v-builds.sh" --out results/pipeline/zero-bubble/v-cut \
    --title "ZB-V's cut: stages of the V evened (after) against chunks evened one by one (before)" "$@"
