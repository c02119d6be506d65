#!/bin/bash
# before: a git worktree of cf0ceb8 at /tmp/wt (the router before tokenize_ahead); after: the commit that added it.
# Alternated twice, 06:02-06:08 UTC on 2 Dec 2026.
cd /work/main
for i in 1 2; do
  for which in before after; do
    if [ $which = before ]; then export PYTHONPATH=/tmp/wt:/tmp/wt/lab; else unset PYTHONPATH; fi
    .venv/bin/python -m extproc bench --scenario overhead --param configs=pick.yaml,pick.yaml+events --param sizes=32 \
      --param rounds=2 --param connections=16 --param id_at=start --out docs/results/precise/tokenize-ahead/overhead-$which-$i > /tmp/overhead-$which-$i.log 2>&1
    echo "$which-$i rc=$? $(date +%T)"
  done
done
