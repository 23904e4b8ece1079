#!/usr/bin/env python3
"""Writes the seed corpora of the text fuzz targets (fuzz_tokenizer, fuzz_chat).

fuzz_tokenizer: one setup byte (bits 0-3 pre-tokenizer, 4 add_bos,
5 parse_special, 6 drop 0xFF's byte token, 7 and no unknown token), then the
text. Run from anywhere; it writes next to itself.
"""
import os

here = os.path.dirname(os.path.abspath(__file__))

TEXTS = {
    "english": b"Hello world! The cat's in the hat, isn't it? We'll see... (42 items), 2024.",
    "unicode": "caf\u00e9 na\u00efve \u00fcber \u00c5\u00c4\u00d6 \u65e5\u672c\u8a9e \U0001f642 \u0661\u0662\u0663".encode(),
    "specials": b"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<tool>ab<|im<|endoftext|>",
    "spaces": b"  a\t\tb \n\n  c   \r\n\r\n x    \n",
    "numbers": b"1 12 123 1234 12345 3.14159 x1y22z333",
    "contractions": b"I'M YOU'RE he'S we'LL they'D 's 't",
    "invalid_utf8": b"ok \xff\xfe \xc3 \xe6\x97 \xf0\x9f\x99 \xed\xa0\x80 \xc0\xaf end\xff",
    "empty": b"",
}


def main():
    d = os.path.join(here, "tokenizer")
    os.makedirs(d, exist_ok=True)
    for i, (name, text) in enumerate(TEXTS.items()):
        # spread the setups: every pre-tokenizer family, both flags, the 0xFF modes
        for j, mode in enumerate(((i * 3) % 16 | 0x30, (i * 5 + 1) % 16 | 0x40, (i + 2) % 16 | 0xC0)):
            with open(os.path.join(d, f"{name}_{j}"), "wb") as f:
                f.write(bytes([mode]) + text)


if __name__ == "__main__":
    main()
