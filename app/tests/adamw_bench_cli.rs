//! Guards against the binary's optimizer bench mode breaking: a small run says which
//! SIMD level ran and why, then prints one table row per (size, threads, path;
//! compact-moment paths included) with a positive rate, a probe fraction, a positive
//! in-cache rate and what limits the step; a level forced by `--simd` or by
//! `TIDESTORE_SIMD` is the one that runs; impossible flags exit 2 naming the flag.

use std::process::Command;

fn tidestore(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tidestore"))
        .args(args)
        .output()
        .expect("the binary runs")
}

#[test]
fn a_small_run_prints_a_row_per_setting() {
    let out = tidestore(&[
        "adamw-bench",
        "--params",
        "100000,200000",
        "--threads",
        "1",
        "--repeats",
        "1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines();
    let level = lines.next().unwrap_or_default();
    assert!(
        level.starts_with("SIMD level: ") && level.contains("the best this CPU supports"),
        "{level}"
    );
    let header = lines.next().unwrap_or_default();
    assert!(
        header.contains("Gparams/s") && header.contains("cacheGp/s"),
        "{header}"
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(
        rows.len(),
        8,
        "2 sizes x 1 thread count x 4 paths (fp32, bf16, m-bf16, m-int8):\n{stdout}"
    );
    for row in rows {
        let rate: f64 = row[5].parse().expect("Gparams/s is a number");
        let fraction: f64 = row[8].parse().expect("fraction is a number");
        let cache: f64 = row[9].parse().expect("cacheGp/s is a number");
        assert!(rate > 0.0 && fraction > 0.0 && cache > 0.0, "{row:?}");
        assert!(["compute", "memory"].contains(&row[10]), "{row:?}");
    }
}

#[test]
fn impossible_flags_exit_2_naming_the_flag() {
    for (flag, value) in [("--threads", "0"), ("--params", "0"), ("--repeats", "0")] {
        let out = tidestore(&["adamw-bench", flag, value]);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(flag));
    }
}

/// The level named by the flag, else by the environment variable, runs every row, and
/// the first line says so.
#[test]
fn a_forced_level_runs_and_is_named_with_its_reason() {
    let small = ["--params", "20000", "--threads", "1", "--repeats", "1"];
    let cases: [(&[&str], Option<&str>, &str); 3] = [
        (&["--simd", "scalar"], None, "forced by --simd"),
        (&[], Some("scalar"), "forced by TIDESTORE_SIMD"),
        (&["--simd", "scalar"], Some("avx2"), "forced by --simd"),
    ];
    for (flags, env, why) in cases {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidestore"));
        cmd.arg("adamw-bench").args(small).args(flags);
        match env {
            Some(v) => cmd.env("TIDESTORE_SIMD", v),
            None => cmd.env_remove("TIDESTORE_SIMD"),
        };
        let out = cmd.output().expect("the binary runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let first = stdout.lines().next().unwrap_or_default();
        assert!(
            first.starts_with("SIMD level: scalar (") && first.contains(why),
            "{flags:?} {env:?}: {first}"
        );
        for row in stdout.lines().skip(2) {
            assert_eq!(row.split_whitespace().nth(3), Some("Scalar"), "{row}");
        }
    }
    let out = Command::new(env!("CARGO_BIN_EXE_tidestore"))
        .arg("adamw-bench")
        .args(small)
        .env("TIDESTORE_SIMD", "avx3")
        .output()
        .expect("the binary runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("TIDESTORE_SIMD"));
}
