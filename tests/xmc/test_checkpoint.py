import numpy as np
import pytest

from xmc.checkpoint import HeadBlock, ServingHead, fit_pca_head, load_checkpoint, uses_sentence_normalize


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


def psi_head(uids: list[str] | None, rows: int = 3) -> ServingHead:
    """A two-block head whose Ψ row r is the unit vector e_r of the second block."""
    rng = np.random.default_rng(0)
    blocks = [
        HeadBlock("g1_de", rng.normal(size=(4, 6)), np.zeros(4)),
        HeadBlock("g2_clf", rng.normal(size=(4, 6)), np.zeros(4)),
    ]
    return ServingHead(blocks, label_table=np.eye(4)[:rows], label_table_block=1, label_uids=uids)


def test_psi_rows_follow_labels_by_uid_through_reordering_and_additions(tmp_path):
    head = psi_head(["a", "b", "c"])
    head.save(tmp_path)
    head = ServingHead.load(tmp_path)
    pooled = np.random.default_rng(1).normal(size=(4, 6))
    vectors = head.label_vectors(pooled, ["c", "new", "a", "b"])  # reordered, one label added
    scale = head.block_scale
    np.testing.assert_allclose(vectors[0, 4:], np.eye(4)[2] * scale)  # c: its own row
    np.testing.assert_allclose(vectors[2, 4:], np.eye(4)[0] * scale)
    np.testing.assert_allclose(vectors[3, 4:], np.eye(4)[1] * scale)
    zero_shot = head.query_vectors(pooled)[1, 4:]  # the new label: g2 of its own text
    np.testing.assert_allclose(vectors[1, 4:], zero_shot)
    assert head.unseen_labels(["c", "new", "a", "b"]) == ["new"]


def test_a_head_without_uids_must_match_the_label_count_and_says_so():
    head = psi_head(None)
    pooled = np.zeros((3, 6)) + 0.1
    np.testing.assert_allclose(head.label_vectors(pooled)[:, 4:], np.eye(4)[:3] * head.block_scale)
    with pytest.raises(ValueError, match="3 rows for 4 labels and no uids"):
        head.label_vectors(np.zeros((4, 6)) + 0.1, ["a", "b", "c", "d"])
