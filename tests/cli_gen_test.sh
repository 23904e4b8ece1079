#!/bin/sh
# End-to-end checks of the generating commands on the default model:
#   cli_gen_test.sh CASE KVCACHE_BINARY MODEL
# Exit 0 pass, 1 fail (with the reason), 77 skip (the model is absent and
# KVC_NO_MODEL is set, as tests/cli_status.sh --needs-model).
# Greedy decoding (--temp 0) makes the replies deterministic.
set -u
case_name=$1 kv=$2 model=$3
if [ ! -f "$model" ]; then # a skip only where scripts/setup.sh was told not to fetch it
    [ -n "${KVC_NO_MODEL:-}" ] &&
        { echo "skipped: the default model is absent and KVC_NO_MODEL is set"; exit 77; }
    echo "FAIL: the default model $model is absent: run scripts/fetch_model.sh (or set KVC_NO_MODEL=1)"
    exit 1
fi
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL ($case_name): $*"; for f in "$tmp"/out "$tmp"/err; do
    [ -f "$f" ] && { echo "--- $f"; cat "$f"; }; done; exit 1; }
has_cr() { [ "$(tr -dc '\r' < "$1" | wc -c)" -ne 0 ]; }
# a prompt of 401 tokens: over the 256 that turn progress on
long_prompt() { i=0; while [ $i -lt 40 ]; do
    printf 'The quick brown fox jumps over the lazy dog. '; i=$((i + 1)); done; }

case $case_name in
chat_pipe)
    # turn 2 must reuse turn 1's prompt from the prefix cache; /reset makes
    # turn 3 the same prompt (and reply) as turn 1; nothing after /exit runs
    printf '%s\n' 'What is the capital of France?' 'And of Germany?' '' /reset \
        'What is the capital of France?' /exit 'What is the capital of Italy?' |
        "$kv" chat -m "$model" -t 2 --temp 0 -n 32 -v > "$tmp/out" 2> "$tmp/err" ||
        fail "exit status $?"
    [ "$(wc -l < "$tmp/out")" -eq 3 ] || fail "expected 3 replies"
    r1=$(sed -n 1p "$tmp/out") r2=$(sed -n 2p "$tmp/out") r3=$(sed -n 3p "$tmp/out")
    case $r1 in *Paris*) ;; *) fail "turn 1 does not say Paris" ;; esac
    case $r2 in *Berlin*) ;; *) fail "turn 2 does not say Berlin" ;; esac
    [ "$r3" = "$r1" ] || fail "turn 3 after /reset differs from turn 1"
    grep -q 'conversation reset' "$tmp/err" || fail "no reset notice"
    grep -q 'turn 4' "$tmp/err" && fail "a turn ran after /exit"
    # "turn T: reused N of M prompt tokens"
    reuse() { sed -n "s/.*turn $1: reused \([0-9]*\) of \([0-9]*\) prompt tokens.*/\\$2/p" \
        "$tmp/err"; }
    n1=$(reuse 1 1) m1=$(reuse 1 2) n2=$(reuse 2 1) m2=$(reuse 2 2) n3=$(reuse 3 1) m3=$(reuse 3 2)
    [ -n "$m1" ] && [ -n "$m2" ] && [ -n "$m3" ] || fail "missing reuse lines"
    [ "$n1" -eq 0 ] || fail "turn 1 reused $n1 tokens from an empty cache"
    [ "$m2" -gt "$m1" ] || fail "turn 2's prompt ($m2) does not hold turn 1's ($m1)"
    # pages hold 16 tokens: all of turn 1's prompt but its last partial page
    [ "$n2" -ge $((m1 - 15)) ] || fail "turn 2 reused $n2 of turn 1's $m1 prompt tokens"
    [ "$n2" -lt "$m2" ] || fail "turn 2 reused its whole prompt"
    [ "$m3" -eq "$m1" ] || fail "after /reset the prompt has $m3 tokens, turn 1 had $m1"
    [ "$n3" -ge $((m1 - 15)) ] || fail "turn 3 reused only $n3 of $m3"
    has_cr "$tmp/err" && fail "progress written to a piped stderr"
    ;;
chat_template)
    # --chat-template and --system: turn 1's prompt must be exactly the text
    # this template renders, counted by `run -f` on that text
    printf '%s' "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}
{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}" > "$tmp/tmpl.jinja"
    printf 'system: Answer in one word.\nuser: Name a colour.\nassistant:' > "$tmp/rendered"
    echo 'Name a colour.' | "$kv" chat -m "$model" -t 2 -n 4 -v --chat-template "$tmp/tmpl.jinja" \
        -s 'Answer in one word.' > "$tmp/out" 2> "$tmp/err" || fail "chat exit status $?"
    m=$(sed -n 's/.*turn 1: reused [0-9]* of \([0-9]*\) prompt tokens.*/\1/p' "$tmp/err")
    "$kv" run -m "$model" -t 2 -n 1 -f "$tmp/rendered" > /dev/null 2> "$tmp/err2" ||
        fail "run exit status $?"
    want=$(sed -n 's/.*| prompt \([0-9]*\) tokens in.*/\1/p' "$tmp/err2")
    [ -n "$m" ] && [ -n "$want" ] || fail "counts missing"
    [ "$m" -eq "$want" ] || fail "chat's prompt has $m tokens, the template renders $want"
    # the model's own template gives another prompt
    echo 'Name a colour.' | "$kv" chat -m "$model" -t 2 -n 4 -v -s 'Answer in one word.' \
        > /dev/null 2> "$tmp/err3" || fail "chat exit status $?"
    m0=$(sed -n 's/.*turn 1: reused [0-9]* of \([0-9]*\) prompt tokens.*/\1/p' "$tmp/err3")
    [ -n "$m0" ] && [ "$m0" -ne "$m" ] || fail "--chat-template changed nothing ($m0 tokens)"
    # a template that cannot render is refused before the first message
    printf '{%% bogus %%}' > "$tmp/bad.jinja"
    echo hi | "$kv" chat -m "$model" --chat-template "$tmp/bad.jinja" > "$tmp/out" 2> "$tmp/err" &&
        fail "a bad template accepted"
    grep -q 'kvcache: chat: .*bogus' "$tmp/err" || fail "no message for a bad template"
    [ -s "$tmp/out" ] && fail "output despite a bad template"
    # a conversation past -c: the message is refused (the first message:
    # /reset would not help); the only one, so no turn ran: exit 1
    printf 'Tell me a long story about a dragon and a knight.\n' |
        "$kv" chat -m "$model" -c 32 -n 4 > "$tmp/out" 2> "$tmp/err"
    st=$?
    [ $st -eq 1 ] || fail "exit status $st, expected 1 (no message answered)"
    grep -q 'the conversation would hold [0-9]* tokens, the context 32: a shorter message, or -c' \
        "$tmp/err" || fail "no message past the context"
    [ -s "$tmp/out" ] && fail "a reply past the context"
    ;;
run_file)
    # -f FILE and -f - give what -p gives (one trailing newline dropped)
    "$kv" run -m "$model" -t 2 -n 6 -q -p 'The capital of France is' > "$tmp/want" ||
        fail "run -p exit status $?"
    echo 'The capital of France is' > "$tmp/prompt"
    "$kv" run -m "$model" -t 2 -n 6 -q -f "$tmp/prompt" > "$tmp/out" || fail "run -f exit status $?"
    cmp -s "$tmp/out" "$tmp/want" || fail "-f FILE differs from -p"
    "$kv" run -m "$model" -t 2 -n 6 -q -f - < "$tmp/prompt" > "$tmp/out" ||
        fail "run -f - exit status $?"
    cmp -s "$tmp/out" "$tmp/want" || fail "-f - differs from -p"
    grep -q '^The capital of France is .' "$tmp/want" || fail "no continuation"
    "$kv" run -m "$model" -p x -f "$tmp/prompt" > "$tmp/out" 2> "$tmp/err" &&
        fail "-p with -f accepted"
    grep -q 'not both' "$tmp/err" || fail "no message for -p with -f"
    "$kv" run -m "$model" -f "$tmp/missing" > "$tmp/out" 2> "$tmp/err" &&
        fail "a missing file accepted"
    grep -q 'cannot read' "$tmp/err" || fail "no message for a missing file"
    ;;
progress_pipe)
    # a long prompt with stderr not a terminal: timings only, no \r progress
    long_prompt > "$tmp/prompt"
    "$kv" run -m "$model" -t 2 -n 1 -f "$tmp/prompt" > "$tmp/out" 2> "$tmp/err" ||
        fail "exit status $?"
    grep -q '| prompt 401 tokens' "$tmp/err" || fail "the prompt is not 401 tokens"
    has_cr "$tmp/err" && fail "CR progress on a piped stderr"
    grep -q 'prompt: ' "$tmp/err" && fail "progress on a piped stderr"
    ;;
progress_tty)
    # the same under a pseudo-terminal (util-linux script): the progress line
    command -v script > /dev/null || fail "no script(1) (Debian: bsdutils, an essential package)"
    long_prompt > "$tmp/prompt"
    script -qec "'$kv' run -m '$model' -t 2 -n 1 -f '$tmp/prompt' 2>&1 >/dev/null" /dev/null \
        > "$tmp/out" < /dev/null || fail "exit status $?"
    tr '\r' '\n' < "$tmp/out" | grep -q '^prompt: [0-9]* / 401 tokens' ||
        fail "no progress line on a terminal"
    # with -q, none
    script -qec "'$kv' run -m '$model' -t 2 -n 1 -q -f '$tmp/prompt' 2>&1 >/dev/null" /dev/null \
        > "$tmp/out" < /dev/null || fail "exit status $?"
    grep -q 'prompt: ' "$tmp/out" && fail "progress despite -q"
    ;;
serve_sync)
    # B 2, gen 8: both prompts computed in full, 8 decode steps of 2 rows
    "$kv" bench-serve -m "$model" --sync --batch 2 --prompt-len 40 --gen 8 --kv-dtype f16,int8 \
        -t 2 --json > "$tmp/out" 2> "$tmp/err" || fail "exit status $?"
    [ "$(grep -c '"mode": "sync"' "$tmp/out")" -eq 2 ] || fail "expected 2 sync cases"
    for f in '"batch": 2,' '"prefill_tokens": 80,' '"decode_tokens": 16,' \
        '"decode_mean_batch": 2.00,' '"cached_tokens": 0,' '"preemptions": 0,'; do
        [ "$(grep -c -F "$f" "$tmp/out")" -eq 2 ] || fail "not in both cases: $f"
    done
    grep -q '"kv": "float16".*"kv_bytes_per_token": 23040,' "$tmp/out" || fail "f16 KV bytes"
    # --kv-dtype int8 names the compressed format kivi8 (docs/KV_FORMATS.md)
    grep -q '"kv": "kivi8".*"kv_bytes_per_token": 12240,' "$tmp/out" || fail "kivi8 KV bytes"
    grep -q '"decode_tok_s": 0.00' "$tmp/out" && fail "a zero decode rate"
    # the same greedy tokens as the engine generates for these prompts
    "$kv" bench-serve -m "$model" --batch 2 --prompt-len 40 --gen 8 --kv-dtype f16,int8 \
        -t 2 --json > "$tmp/engine" 2> "$tmp/err" || fail "engine exit status $?"
    fnv() { sed -n 's/.*"kv": "\([a-z0-9]*\)".*"tokens_fnv": "\([0-9a-f]*\)".*/\1 \2/p' "$1"; }
    [ "$(fnv "$tmp/out" | wc -l)" -eq 2 ] || fail "no token hashes"
    [ "$(fnv "$tmp/out")" = "$(fnv "$tmp/engine")" ] ||
        fail "--sync generated other tokens than the engine: $(fnv "$tmp/out")" \
            "vs $(fnv "$tmp/engine")"
    # the model read into memory instead of mapped: the same tokens
    "$kv" bench-serve -m "$model" --batch 2 --prompt-len 40 --gen 8 --kv-dtype f16,int8 \
        -t 2 --json --no-mmap > "$tmp/nommap" 2> "$tmp/err" || fail "--no-mmap exit status $?"
    [ "$(fnv "$tmp/nommap")" = "$(fnv "$tmp/engine")" ] ||
        fail "--no-mmap generated other tokens: $(fnv "$tmp/nommap") vs $(fnv "$tmp/engine")"
    # a shared prompt: copies 2 and 3 reuse its 2 full pages, compute 8 rows
    "$kv" bench-serve -m "$model" --sync --batch 3 --prompt-len 40 --gen 2 --kv-dtype f16 \
        -t 2 --shared-prompt --json > "$tmp/out" 2> "$tmp/err" || fail "exit status $?"
    grep -q '"prefill_tokens": 56,.*"cached_tokens": 64,' "$tmp/out" || fail "shared prompt"
    # ... and with the prefix cache off, every copy computes 40
    "$kv" bench-serve -m "$model" --sync --batch 3 --prompt-len 40 --gen 2 --kv-dtype f16 \
        -t 2 --shared-prompt --no-prefix-cache --json > "$tmp/out" 2> "$tmp/err" ||
        fail "exit status $?"
    grep -q '"prefill_tokens": 120,.*"cached_tokens": 0,' "$tmp/out" || fail "no prefix cache"
    # the table: mode line and dec_B = B
    "$kv" bench-serve -m "$model" --sync --batch 2 --prompt-len 24 --gen 2 --kv-dtype f16 -t 2 \
        > "$tmp/out" 2> "$tmp/err" || fail "exit status $?"
    grep -q '^# mode sync (llama-batched-bench protocol)' "$tmp/out" || fail "no mode line"
    grep -Eq '^float16 +2 +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +2\.0 +23040 +0 +0$' "$tmp/out" ||
        fail "table row"
    has_cr "$tmp/err" && fail "progress on a piped stderr"
    ;;
serve_text)
    # -p / -f: every sequence gets the text (shared), its token count is the
    # prompt length; --prompt-len may only shorten it
    echo 'The capital of France is Paris, and the capital of Germany is Berlin.' > "$tmp/prompt"
    "$kv" bench-serve -m "$model" -f "$tmp/prompt" --batch 2 --gen 2 --kv-dtype f16 -t 2 --json \
        > "$tmp/out" 2> "$tmp/err" || fail "exit status $?"
    n=$(sed -n 's/.*"prompt_len": \([0-9]*\),.*/\1/p' "$tmp/out")
    [ -n "$n" ] && [ "$n" -gt 10 ] || fail "prompt length $n"
    grep -q '"prompt": "text", "shared_prompt": true' "$tmp/out" || fail "text prompt fields"
    "$kv" bench-serve -m "$model" -f "$tmp/prompt" --prompt-len 500 --batch 1 --gen 2 \
        > "$tmp/out" 2> "$tmp/err" && fail "--prompt-len past the text accepted"
    grep -q "the prompt has $n tokens, fewer than --prompt-len" "$tmp/err" || fail "message"
    # run and perplexity take --no-mmap too: the same reply, the same perplexity
    "$kv" run -m "$model" -t 2 -n 8 -f "$tmp/prompt" > "$tmp/a" 2> "$tmp/err" || fail "run $?"
    "$kv" run -m "$model" -t 2 -n 8 -f "$tmp/prompt" --no-mmap > "$tmp/b" 2> "$tmp/err" ||
        fail "run --no-mmap exit status $?"
    cmp -s "$tmp/a" "$tmp/b" || fail "run --no-mmap replied otherwise"
    for i in 1 2 3 4 5 6; do cat "$tmp/prompt"; done > "$tmp/text"
    "$kv" perplexity -m "$model" -f "$tmp/text" -c 32 -t 2 --json > "$tmp/a" 2> "$tmp/err" ||
        fail "perplexity $?"
    "$kv" perplexity -m "$model" -f "$tmp/text" -c 32 -t 2 --json --no-mmap > "$tmp/b" \
        2> "$tmp/err" || fail "perplexity --no-mmap exit status $?"
    grep -q '"ppl": [0-9]' "$tmp/a" && cmp -s "$tmp/a" "$tmp/b" ||
        fail "perplexity --no-mmap: $(cat "$tmp/b") vs $(cat "$tmp/a")"
    ;;
*)
    echo "unknown case $case_name"; exit 1 ;;
esac
echo "pass: $case_name"
