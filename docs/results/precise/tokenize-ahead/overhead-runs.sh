#!/bin/bash
# before: the router of cf0ceb8 (a git worktree at /tmp/wt, run from there so `python -m extproc` imports it);
# after: the working tree (/work/main) at 9f5cf68 plus the overhead rig counting reasons (the before runs use the old rig, which only counts views). Alternated twice, 06:51-06:58 UTC on 2 Dec 2026.
for i in 1 2; do
  for which in before after; do
    if [ $which = before ]; then cd /tmp/wt; export PYTHONPATH=/tmp/wt/lab; else cd /work/main; unset PYTHONPATH; fi
    /work/main/.venv/bin/python -m extproc serve --help | grep -q tokenize-inline && echo "$which: new router" || echo "$which: old router"
    /work/main/.venv/bin/python -m extproc bench --scenario overhead --param configs=pick.yaml,pick.yaml+events --param sizes=32 \
      --param rounds=2 --param connections=16 --param id_at=start --out /work/main/docs/results/precise/tokenize-ahead/overhead-$which-$i > /tmp/overhead-$which-$i.log 2>&1
    echo "$which-$i rc=$? $(date +%T)"
  done
done
