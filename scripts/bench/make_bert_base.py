"""A BERT-base-shaped random checkpoint (12 layers, 768 hidden, 30,522-token WordPiece vocab of
made-up words) with sentence-transformers' mean pooling + Normalize, for `bench embed`."""
import sys
from pathlib import Path
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import torch
from transformers import BertConfig, BertModel, BertTokenizerFast
from tests.models.pooling_utils import SPECIAL, randomize, save_sentence_transformers
path = Path(sys.argv[1]); path.mkdir(parents=True, exist_ok=True)
vocab = SPECIAL + list("abcdefghijklmnopqrstuvwxyz?,.")
vocab += [f"w{i}" for i in range(30522 - len(vocab))]
(path / "vocab.txt").write_text("\n".join(vocab) + "\n")
tok = BertTokenizerFast(str(path / "vocab.txt")); tok.save_pretrained(str(path))
model = BertModel(BertConfig(vocab_size=len(vocab))).eval()
randomize(model, std=0.02)
model.save_pretrained(str(path))
save_sentence_transformers(path, 768, "mean", True)
print("saved", path)
