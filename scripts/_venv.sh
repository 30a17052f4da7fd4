# Sourced by the scripts that install or run things: the project's own virtual environment, so that set-up never
# touches the Python the user has active (its torch, its editable installs) and works where the system Python forbids
# installing into it. HF_QKNORM_VENV names the folder (default .venv in the clone). A folder there that these scripts
# did not make (no marker file) is refused, never installed into.
#
#   VENV  the environment's folder          PY  its python
#   lane_env DIR   makes DIR a second environment that sees VENV's packages (torch, peft, ...) behind its own, for
#                  a Transformers lane or a wheel test: one `pip install` into it then shadows only what it installs.
HF_QKNORM_MARKER=.made-by-hf-qknorm
VENV=$(realpath -m "${HF_QKNORM_VENV:-.venv}")
PY="$VENV/bin/python"

hf_qknorm_make_env() {  # DIR: a fresh venv with the marker; refuses a folder it did not make
  local dir=$1
  if [ -e "$dir" ] && [ ! -e "$dir/$HF_QKNORM_MARKER" ]; then
    echo "$0: $dir exists and was not made by these scripts; remove it, or set HF_QKNORM_VENV to a new folder" >&2
    exit 2
  fi
  if [ ! -x "$dir/bin/python" ]; then
    local base=${PYTHON:-python3}
    if ! "$base" -m venv "$dir"; then
      echo "$0: '$base -m venv $dir' failed; install Python's venv module (Debian: apt install python3-venv) or set PYTHON" >&2
      exit 2
    fi
    touch "$dir/$HF_QKNORM_MARKER"
  fi
}

lane_env() {  # DIR
  local dir=$1
  hf_qknorm_make_env "$dir"
  local main_site lane_site
  main_site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  lane_site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # a .pth line that starts with "import" runs at start-up: addsitedir appends VENV's site-packages (and runs its .pth
  # files) after the lane's own, so what the lane installs comes first
  echo "import site; site.addsitedir('$main_site')" > "$lane_site/zz_hf_qknorm_main_env.pth"
}
