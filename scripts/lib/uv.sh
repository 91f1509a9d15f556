# shellcheck shell=bash
# uv for the installing scripts (scripts/setup.sh, scripts/check_mindspeed.sh): one copy per machine, pip-installed
# from PyPI into its own small venv under GSPO_CI_CACHE (default ~/.cache/gspo-ci), with one package cache beside it
# (uv/). uv installs a lock from a warm cache in seconds where pip takes minutes (the CPU lock: 30 s with bytecode
# against pip's ~150 s, measured 2026-12-02 on the 2-core CI box), hardlinking the files from its cache.
#
#   source scripts/lib/uv.sh
#   uv=$(uv_bin "$PY")            # uv's path, installed on first use with PY's pip; status 1 when it cannot be
#   uv_sources "$PY"              # PY's pip's index settings (pip.conf, PIP_* env) as uv options, one per line

UV_VERSION=0.13.9
UV_CACHE_ROOT=${GSPO_CI_CACHE:-$HOME/.cache/gspo-ci}

uv_bin() {  # uv_bin PY: print uv's path, installing it with PY's pip on first use (built aside and moved into place
  # whole, so two first runs at once each end with a complete one)
  local py=$1 dir="$UV_CACHE_ROOT/uv-$UV_VERSION" tmp
  if [[ ! -x "$dir/bin/uv" ]]; then
    mkdir -p "$UV_CACHE_ROOT"
    tmp="$UV_CACHE_ROOT/.uv-$UV_VERSION.tmp-$$"
    # their output to stderr: this function's stdout is the path its caller captures
    if ! { "$py" -m venv "$tmp" >&2 && "$tmp/bin/python" -m pip install -q --disable-pip-version-check \
      "uv==$UV_VERSION" >&2 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }; then
      rm -rf "$tmp"  # (the grep drops pip's note on this machine's empty file:// indexes)
      return 1
    fi
    mv -T "$tmp" "$dir" 2> /dev/null || rm -rf "$tmp"  # another run's got there first: theirs is as good
  fi
  [[ -x "$dir/bin/uv" ]] || return 1  # a leftover folder without it
  echo "$dir/bin/uv"
}

uv_sources() {  # uv_sources PY: the indexes and find-links pip is configured with, as uv options (one per line).
  # uv reads no pip.conf; without these it would miss what a machine serves from its own disk (this CI box: the
  # torch +cpu wheel in a find-links folder). pip considers every index's versions; so does unsafe-best-match.
  # Not carried over: no-index, constraint (the locks pin every package) and cert (uv trusts its own roots); of
  # several index-url settings the first pip lists (its environment's, where set) is kept.
  local line key value item index=""
  echo "--index-strategy=unsafe-best-match"
  while IFS= read -r line; do
    key=${line%%=*} value=${line#*=}
    value=${value#\'} value=${value%\'}
    value=${value//\\n/ }  # a multi-line pip.conf value: pip prints its newlines as \n
    for item in $value; do
      case "$key" in
        *.extra-index-url) echo "--extra-index-url=$item" ;;
        *.index-url) [[ -n "$index" ]] || { index=$item; echo "--index-url=$item"; } ;;
        *.find-links) echo "--find-links=$item" ;;
      esac
    done
  done < <("$1" -m pip config list 2> /dev/null) | awk '!seen[$0]++'  # pip lists a setting once per source
}
