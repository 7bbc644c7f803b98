# Sourced by the benchmarks: `data_for MODEL OUT` prints the data directory MODEL
# reads. gpt.dsl reads Penn Treebank as token ids, made once under OUT by
# scripts/ptb-tokens.py; the others read DISTC_DATA (empty when unset).
data_for() {
  case "$1" in
    *gpt.dsl)
      [ -d "$2/gpt-data/ptb-tokens" ] ||
        python3 scripts/ptb-tokens.py "${DISTC_DATA:?gpt.dsl needs DISTC_DATA}/ptb" \
          "$2/gpt-data/ptb-tokens" >/dev/null
      echo "$2/gpt-data" ;;
    *) echo "${DISTC_DATA:-}" ;;
  esac
}
