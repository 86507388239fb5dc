"""The server's fuzz targets (``tests/fuzz_server_targets.py``; hypothesis, derandomized): input image
headers and files, Host / Origin headers, the MP4 check of outputs and job-store records at a
restart — no outcome but a result or the surface's documented error."""

import fuzz_server_targets as ft


def test_fuzz_input_images():
    ft.fuzz_input_images()
    assert ft.COUNTS["images"] >= 150


def test_fuzz_host_and_origin_headers():
    ft.fuzz_host_origin()
    assert ft.COUNTS["host_origin"] >= 200


def test_fuzz_mp4_check():
    ft.fuzz_mp4_check()
    assert ft.COUNTS["mp4"] >= 150


def test_fuzz_job_store_records():
    ft.fuzz_job_records()
    assert ft.COUNTS["job_records"] >= 60
