"""bench.profile_graph --summarize groups an ncu CSV log by kernel (units converted)."""
from bench.profile_graph import summarize

CSV = '''==PROF== Connected to process 1
"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"
"0","_rms_norm_2d(Array<float, 2>)","gpu__time_duration.sum","usecond","3.52"
"1","sm90_xmma_gemm_bf16bf16_bf16f32","gpu__time_duration.sum","usecond","35.10"
"2","_rms_norm_2d(Array<float, 2>)","gpu__time_duration.sum","nsecond","3,480"
"3","_rms_norm_2d(Array<float, 2>)","dram__bytes.sum","byte","123"
'''


def test_summarize_groups_kernels(tmp_path, capsys):
    p = tmp_path / "ncu.csv"
    p.write_text(CSV)
    summarize(str(p))
    out = capsys.readouterr().out
    norm = next(line for line in out.splitlines() if line.startswith("_rms_norm_2d"))
    assert norm.split()[1:4] == ["2", "7.0", "3.50"]          # 3.52 us + 3,480 ns; other metrics ignored
    assert "42.1" in out.splitlines()[-1]
