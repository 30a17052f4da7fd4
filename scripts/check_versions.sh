#!/usr/bin/env bash
# The version table of docs/compatibility.md, rerun: for every Transformers virtual environment under VENV_DIR
# (each made with `python -m venv --system-site-packages DIR` and one `transformers==X` installed into it; every
# folder with a bin/python that imports transformers counts), run the recipes' tiny runs, the Trainer / QK-Clip /
# Muon / monitor tests, the CLI and the version-shim tests, and print one markdown row per version with the
# passed / failed / skipped counts of each group.
#
#   bash scripts/check_versions.sh /work/venvs                 # every environment, oldest first
#   bash scripts/check_versions.sh /work/venvs tf-5.4 tf-5.17  # only these
#
# Logs and JUnit files go to ${CHECK_VERSIONS_OUT:-runs/check_versions}/<folder>.{log,xml}, the table to its
# table.md; CHECK_VERSIONS_TABLE_ONLY=1 prints the table from an earlier run's files without running anything.
# About 4 minutes a version on 2 shared cores.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV_DIR=${1:?usage: scripts/check_versions.sh VENV_DIR [FOLDER ...]}
shift
OUT=${CHECK_VERSIONS_OUT:-runs/check_versions}
mkdir -p "$OUT"
if [ $# -gt 0 ]; then
  FOLDERS=("$@")
else
  mapfile -t FOLDERS < <(for d in "$VENV_DIR"/*/; do [ -x "$d/bin/python" ] && basename "$d"; done | sort -V)
fi
# groups, as the table's columns (by test file, or file::test)
RECIPES="tests/training/test_trainer.py::test_recipes_help_and_tiny_runs tests/training/test_trainer.py::test_pretrain_tiny_recipe_tiny_run
  tests/recipes/test_lr_sweep.py tests/recipes/test_conversion_recovery.py tests/training/test_distributed.py"
TRAINING="tests/training/test_trainer.py tests/training/test_qk_clip.py tests/training/test_muon.py tests/training/test_monitor.py tests/training/test_qk_lr.py tests/training/test_training.py"
CLI="tests/cli/test_cli.py tests/test_upstream.py"
export ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-AVX512_CORE_BF16} TRITON_INTERPRET=${TRITON_INTERPRET:-1}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's hf_qknorm, not an installed one
for folder in "${FOLDERS[@]}"; do
  [ -n "${CHECK_VERSIONS_TABLE_ONLY:-}" ] && break  # only the table, from the files of earlier runs
  py="$VENV_DIR/$folder/bin/python"
  if ! version=$("$py" -c "import transformers; print(transformers.__version__)" 2>/dev/null); then
    echo "skipping $folder: no transformers there" >&2
    continue
  fi
  start=$(date +%s)
  # $RECIPES' entries in tests/training/test_trainer.py are left out here: $TRAINING runs that file whole
  # shellcheck disable=SC2086
  HF_QKNORM_PYTHON="$py" "$py" -m pytest -q -p no:cacheprovider --junitxml="$OUT/$folder.xml" \
    $(printf '%s\n' $RECIPES | grep -v '^tests/training/test_trainer.py::') $TRAINING $CLI > "$OUT/$folder.log" 2>&1
  echo "$folder $version $(( $(date +%s) - start ))" >> "$OUT/times.txt"
done
python3 - "$OUT" "$RECIPES" "$TRAINING" "$CLI" "${FOLDERS[@]}" <<'PY' | tee "$OUT/table.md"
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, recipes, training, cli, *folders = sys.argv[1:]
groups = {"recipes' tiny runs": recipes.split(), "Trainer / QK-Clip / Muon / monitor": training.split(),
          "CLI + upstream": cli.split()}
times = {}
if (Path(out) / "times.txt").is_file():
    for line in (Path(out) / "times.txt").read_text().splitlines():
        folder, version, secs = line.split()
        times[folder] = (version, secs)


def group_of(case) -> str:
    path = case.get("classname", "").replace(".", "/") + ".py"
    node = path + "::" + case.get("name", "").split("[")[0]
    for name, entries in groups.items():  # a group naming the test itself wins over one naming its whole file
        if node in entries:
            return name
    return next((name for name, entries in groups.items() if path in entries), None)  # None: not in the table


print("| Transformers | " + " | ".join(f"{g}: passed / failed / skipped" for g in groups) + " | failures | time |")
print("|---|" + "---|" * len(groups) + "---|---|")
for folder in folders:
    # <folder>.xml from this script; <folder>.<anything>.xml from other runs on that version (a CI lane, a rerun)
    xmls = sorted(Path(out).glob(f"{folder}.xml")) + sorted(Path(out).glob(f"{folder}.*.xml"))
    if not xmls:
        continue
    counts = {g: [0, 0, 0] for g in groups}
    failed = []
    for case in (c for xml in xmls for c in ET.parse(xml).iter("testcase")):
        g = group_of(case)
        if g is None:
            continue
        if case.find("failure") is not None or case.find("error") is not None:
            counts[g][1] += 1
            failed.append(f"{case.get('classname').split('.')[-1]}::{case.get('name')}")
        elif case.find("skipped") is not None:
            counts[g][2] += 1
        else:
            counts[g][0] += 1
    version, secs = times.get(folder, (folder, None))
    own = xmls == [Path(out) / f"{folder}.xml"]  # the time is this script's run alone
    took = f"{int(secs) // 60}m{int(secs) % 60:02d}s" if own and secs and secs.isdigit() else "-"
    cells = " | ".join(" / ".join(map(str, counts[g])) for g in groups)
    print(f"| {version} | {cells} | {', '.join(failed) or '-'} | {took} |")
PY
