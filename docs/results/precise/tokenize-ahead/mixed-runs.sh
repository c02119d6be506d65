#!/bin/bash
# id_at=mixed (one request in ten all new): the router of cf0ceb8 (a git worktree at /tmp/wt, run from
# there so `python -m extproc` imports it; the rig from this tree via PYTHONPATH) against this tree's.
# 07:15-07:21 UTC on 2 Dec 2026, the tree at ae62630 plus id_at=mixed.
for i in 1 2; do
  for which in before after; do
    if [ $which = before ]; then cd /tmp/wt; else cd /work/main; fi
    export PYTHONPATH=/work/main/lab
    /work/main/.venv/bin/python -m extproc serve --help | grep -q tokenize-inline && echo "$which: new router" || echo "$which: old router"
    /work/main/.venv/bin/python -m extproc bench --scenario overhead --param configs=pick.yaml,pick.yaml+events --param sizes=32 \
      --param rounds=2 --param connections=16 --param id_at=mixed --out /work/main/docs/results/precise/tokenize-ahead/mixed-$which-$i > /tmp/mixed-$which-$i.log 2>&1
    echo "$which-$i rc=$? $(date +%T)"
  done
done
