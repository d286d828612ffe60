"""studies.annif_peer's files for Annif (vocabulary, corpora, projects, punkt_tab) and its reading of
``annif hyperopt``; Annif itself runs only in its own venv (``make annif-venv``)."""

import configparser
import os
import subprocess
from pathlib import Path

import pytest

from studies.annif_peer import run as annif_peer
from xmc.data import load_jsonl_split

ROOT = Path(__file__).resolve().parents[2]
ANNIF_PYTHON = ROOT / ".venv-annif" / "bin" / "python"


def test_vocab_and_corpus_name_each_label_by_its_id(sample_dir, tmp_path):
    train = load_jsonl_split(sample_dir, "trn")
    annif_peer.write_vocab(tmp_path / "vocab.tsv", train)
    annif_peer.write_corpus(tmp_path / "trn.tsv", train)
    vocab = (tmp_path / "vocab.tsv").read_text(encoding="utf-8").splitlines()
    assert len(vocab) == train.num_labels
    assert vocab[3] == f"<{annif_peer.URI_BASE}3>\t{' '.join(train.labels.texts[3].split())}"
    corpus = (tmp_path / "trn.tsv").read_text(encoding="utf-8").splitlines()
    assert len(corpus) == len(train) and all(line.count("\t") == 1 for line in corpus)
    text, uris = corpus[0].split("\t")
    assert text == " ".join(train.texts[0].split())
    ids = sorted(int(uri.strip("<>").rsplit("/", 1)[1]) for uri in uris.split())
    assert ids == sorted(train.Y[0].indices.tolist())


def test_projects_cfg_has_every_source_and_the_weighted_ensemble():
    weights = {name: 0.1 * (i + 1) for i, name in enumerate(annif_peer.SOURCES)}
    cfg = configparser.ConfigParser()
    cfg.read_string(annif_peer.projects_cfg(104, weights))
    assert cfg.sections() == [*annif_peer.SOURCES, annif_peer.ENSEMBLE]
    assert all(cfg[name]["limit"] == "104" and cfg[name]["vocab"] == annif_peer.VOCAB_ID for name in cfg.sections())
    assert cfg["annif-omikuji-bonsai"]["cluster_k"] == "100" and cfg["annif-fasttext"]["loss"] == "ova"
    sources = dict(item.rsplit(":", 1) for item in cfg[annif_peer.ENSEMBLE]["sources"].split(","))
    assert {name: float(w) for name, w in sources.items()} == pytest.approx(weights, abs=1e-4)


def test_reads_the_weights_annif_hyperopt_recommends():
    output = "Looking for optimal hyperparameters using 10 trials\nGot best NDCG@5 score 0.6710 with:\n---\n"
    output += "sources=annif-fasttext:0.0015,annif-omikuji-parabel:0.4643,annif-omikuji-bonsai:0.5342\n---\n"
    assert annif_peer.parse_weights(output) == {
        "annif-fasttext": 0.0015,
        "annif-omikuji-parabel": 0.4643,
        "annif-omikuji-bonsai": 0.5342,
    }


def test_the_minimal_punkt_tab_is_what_nltk_loads(tmp_path):
    data = annif_peer.write_punkt_tab(tmp_path / "nltk_data")
    names = sorted(p.name for p in (data / "tokenizers" / "punkt_tab" / "english").iterdir())
    assert names == ["abbrev_types.txt", "collocations.tab", "ortho_context.tab", "sent_starters.txt"]
    if not ANNIF_PYTHON.exists():
        pytest.skip("no .venv-annif (make annif-venv): nltk itself not tried")
    code = "import nltk; print(nltk.word_tokenize('How do I dice onions? Fast, please.'))"
    done = subprocess.run(
        [str(ANNIF_PYTHON), "-c", code],
        env={**os.environ, "NLTK_DATA": str(data)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['How', 'do', 'I', 'dice', 'onions', '?', 'Fast', ',', 'please', '.']"
