import numpy as np
import pytest

from training.checkpoint import HeadBlock, ServingHead, fit_pca_head, load_checkpoint, uses_sentence_normalize


def test_pca_head_projects_onto_principal_components():
    rng = np.random.default_rng(0)
    # variance concentrated in 3 directions
    basis = np.linalg.qr(rng.normal(size=(20, 20)))[0][:3]
    x = rng.normal(size=(500, 3)) * [10, 5, 2] @ basis + rng.normal(scale=0.01, size=(500, 20)) + 3.0
    head = fit_pca_head(x, 3, pre_normalize=False)
    projected = x @ head.blocks[0].weight.T + head.blocks[0].bias
    np.testing.assert_allclose(projected.mean(axis=0), 0, atol=1e-4)  # centred
    variances = projected.var(axis=0)
    np.testing.assert_allclose(variances / variances.sum(), [100 / 129, 25 / 129, 4 / 129], atol=0.05)
    vectors = head.query_vectors(x)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_pca_head_refuses_more_dims_than_data():
    with pytest.raises(ValueError, match="cannot fit"):
        fit_pca_head(np.zeros((10, 4)), 8, pre_normalize=False)


def test_head_save_load_roundtrip(tmp_path):
    rng = np.random.default_rng(1)
    head = ServingHead(
        blocks=[
            HeadBlock("g1", rng.normal(size=(4, 6)).astype(np.float32), rng.normal(size=4).astype(np.float32)),
            HeadBlock("g2", rng.normal(size=(4, 6)).astype(np.float32), np.zeros(4, np.float32)),
        ],
        pre_normalize=True,
        label_table=rng.normal(size=(5, 4)).astype(np.float32),
        label_table_block=1,
    )
    head.save(tmp_path)
    loaded = ServingHead.load(tmp_path)
    x = rng.normal(size=(5, 6))
    np.testing.assert_allclose(loaded.query_vectors(x), head.query_vectors(x))
    np.testing.assert_allclose(loaded.label_vectors(x), head.label_vectors(x))
    assert loaded.dim == 8 and loaded.pre_normalize


def test_checkpoint_resolution(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert load_checkpoint(tmp_path).head is None
    assert not uses_sentence_normalize(tmp_path)
    (tmp_path / "modules.json").write_text('[{"type": "sentence_transformers.models.Normalize"}]')
    assert uses_sentence_normalize(tmp_path)
