"""bundle.ivfpq_file reads faiss's format without faiss: its constants are faiss's own."""

import faiss

from bundle.ivfpq_file import METRIC_INNER_PRODUCT


def test_the_metric_the_header_records_is_faiss_inner_product():
    assert METRIC_INNER_PRODUCT == faiss.METRIC_INNER_PRODUCT
