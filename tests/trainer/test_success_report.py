"""The success summary in the termination message: what the operator learns its calibration from."""

from finetune_trainer.contract import FailureReport, SuccessReport, parse_failure_report, parse_success_report
from finetune_trainer.reporting import write_success


def test_the_highest_peak_of_the_local_ranks_is_kept_and_a_failure_report_is_never_overwritten(tmp_path):
    path = tmp_path / "termination-log"
    assert write_success(SuccessReport(steps=10, peak_allocated_bytes=100, peak_reserved_bytes=120), path)
    assert not write_success(SuccessReport(steps=10, peak_allocated_bytes=90, rank=1), path)
    assert write_success(SuccessReport(steps=10, peak_allocated_bytes=110, rank=2), path)
    report = parse_success_report(path.read_text())
    assert report is not None and report.peak_allocated_bytes == 110 and report.rank == 2
    assert parse_failure_report(path.read_text()) is None  # never mistaken for a failure

    failed = tmp_path / "failed"
    failed.write_text(FailureReport(reason="Unknown", phase="forward", step=1, exit_code=1).to_termination_message())
    assert not write_success(SuccessReport(steps=1, peak_allocated_bytes=1), failed)
    assert parse_success_report(failed.read_text()) is None


def test_a_success_report_fits_and_round_trips():
    report = SuccessReport(steps=2000, peak_allocated_bytes=70 << 30, peak_reserved_bytes=75 << 30,
                           device_total_bytes=80 << 30, world_size=8, attempt=2)
    text = report.to_termination_message()
    assert len(text) < 4096 and parse_success_report(text) == report
    assert parse_success_report("RuntimeError: CUDA out of memory") is None


def test_rank_zeros_export_joins_the_report_of_a_local_rank_with_a_higher_peak(tmp_path):
    """Rank 0 merges after the other local ranks wrote theirs: the pod's report keeps the highest peak
    and gains where the export went."""
    from finetune_trainer.contract import ExportFacts

    path = tmp_path / "termination-log"
    assert write_success(SuccessReport(steps=10, peak_allocated_bytes=200, rank=1), path)
    export = ExportFacts(kind="merged", directory="/output/merged", shards=3, total_bytes=123, peak_rss_bytes=456)
    assert write_success(SuccessReport(steps=10, peak_allocated_bytes=100, rank=0, export=export), path)
    report = parse_success_report(path.read_text())
    assert (report.rank, report.peak_allocated_bytes) == (1, 200) and report.export == export
    # A later rank with a lower peak and no export changes nothing.
    assert not write_success(SuccessReport(steps=10, peak_allocated_bytes=50, rank=2), path)
    assert parse_success_report(path.read_text()).export == export
