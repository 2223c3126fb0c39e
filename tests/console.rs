//! `ConsoleSink`: what a query writing to it prints on standard output.
//!
//! The sink writes to the process's stdout, past the test harness's capture, so
//! each test runs the query in a child process (this test binary, running its
//! ignored `console_child` test) and checks the child's stdout: one
//! `[partition] row` line per row, in order within each partition, every row
//! exactly once and nothing else; and that its logs, in a pipe, carry no
//! colour.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use common::config;
use rtflow::prelude::*;

/// What the child runs, from `RTFLOW_CONSOLE_CHILD`: `debug` or `format`.
const CHILD_MODE: &str = "RTFLOW_CONSOLE_CHILD";

/// Lines around the query's output in the child's stdout.
const BEGIN: &str = "console-test: begin";
const END: &str = "console-test: end";

/// Rows per source partition: more than one data message's worth in the first.
const ROWS: [usize; 2] = [600, 250];

/// A row: its source partition, its index there and some text.
type Row = (usize, usize, String);

fn row(partition: usize, index: usize) -> Row {
    let text = match index % 3 {
        0 => format!("row {index}"),
        // Debug quotes and escapes; a custom format prints the text as it is.
        1 => format!("say \"hi\"\t{index}"),
        _ => "naïve ✓".to_owned(),
    };
    (partition, index, text)
}

/// Writes a marker line to stdout, where the sink writes too.
fn mark(line: &str) {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}").unwrap();
    stdout.flush().unwrap();
}

/// The query under test: a two-partition memory source -> console.
#[test]
#[ignore = "the child process of the console tests, which start it themselves"]
fn console_child() {
    let Ok(mode) = std::env::var(CHILD_MODE) else {
        return;
    };
    let input = MemorySource::new(ROWS.len());
    for (partition, rows) in ROWS.into_iter().enumerate() {
        input
            .push_all(partition, (0..rows).map(|index| row(partition, index)))
            .unwrap();
    }
    input.end();
    let flow = Dataflow::new("console");
    let rows = flow.source(input).name("rows");
    match mode.as_str() {
        "debug" => rows.sink(ConsoleSink::new()),
        "logs" => {
            rtflow::logging::init("rtflow_runtime=info");
            rows.sink(ConsoleSink::new())
        }
        "format" => rows.sink(ConsoleSink::with_format(|(p, i, text): &Row| {
            format!("p{p} #{i}: {text}")
        })),
        other => panic!("unknown mode {other}"),
    };
    // On a fresh line: the harness may have left "test console_child ... " open.
    mark(&format!("\n{BEGIN}"));
    let query = common::run_to_end(flow, config("console"));
    mark(END);
    assert_eq!(
        query.metrics().records_written(),
        ROWS.iter().sum::<usize>() as u64
    );
}

/// Runs the child in `mode` and returns the lines it printed between the
/// markers, and its stderr.
fn run_child(mode: &str) -> (Vec<String>, String) {
    let output = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "console_child", "--nocapture"])
        .env(CHILD_MODE, mode)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("the child runs");
    let stdout = String::from_utf8(output.stdout).expect("UTF-8 output");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        output.status.success(),
        "the child failed: {}\n--- stdout:\n{stdout}\n--- stderr:\n{stderr}",
        output.status
    );
    let lines: Vec<&str> = stdout.lines().collect();
    let position = |marker: &str| {
        let found: Vec<usize> = (0..lines.len()).filter(|&i| lines[i] == marker).collect();
        match found[..] {
            [at] => at,
            _ => panic!("{marker:?} is not printed once:\n{stdout}"),
        }
    };
    let (begin, end) = (position(BEGIN), position(END));
    assert!(begin < end, "{stdout}");
    let printed = lines[begin + 1..end]
        .iter()
        .map(|&l| l.to_owned())
        .collect();
    (printed, stderr)
}

/// Checks that `lines` are exactly `expected(partition, index)` for every row,
/// each prefixed by its writer's partition (the source partition: the sink is
/// forward-connected to one reader per partition), in order per partition.
fn check(lines: &[String], expected: impl Fn(usize, usize) -> String) {
    let mut by_partition = vec![Vec::new(); ROWS.len()];
    for line in lines {
        let partition = line
            .strip_prefix('[')
            .and_then(|rest| rest.split_once("] "))
            .and_then(|(partition, _)| partition.parse::<usize>().ok())
            .filter(|&partition| partition < ROWS.len())
            .unwrap_or_else(|| panic!("not a `[partition] row` line: {line:?}"));
        by_partition[partition].push(line.as_str());
    }
    for (partition, printed) in by_partition.iter().enumerate() {
        let wanted: Vec<String> = (0..ROWS[partition])
            .map(|index| format!("[{partition}] {}", expected(partition, index)))
            .collect();
        assert_eq!(
            printed.len(),
            wanted.len(),
            "lines of partition {partition}"
        );
        for (index, (printed, wanted)) in printed.iter().zip(&wanted).enumerate() {
            assert_eq!(printed, wanted, "line {index} of partition {partition}");
        }
    }
}

#[test]
fn prints_each_row_in_its_debug_form_prefixed_by_its_partition() {
    let (lines, _) = run_child("debug");
    check(&lines, |partition, index| {
        format!("{:?}", row(partition, index))
    });
    // The Debug form, spelled out.
    assert!(
        lines.contains(&r#"[0] (0, 0, "row 0")"#.to_owned()),
        "{lines:?}"
    );
    assert!(
        lines.contains(&r#"[1] (1, 4, "say \"hi\"\t4")"#.to_owned()),
        "{lines:?}"
    );
}

#[test]
fn prints_each_row_as_its_format_renders_it() {
    let (lines, _) = run_child("format");
    check(&lines, |partition, index| {
        let (_, _, text) = row(partition, index);
        format!("p{partition} #{index}: {text}")
    });
    assert!(
        lines.contains(&"[1] p1 #2: naïve ✓".to_owned()),
        "{lines:?}"
    );
    assert!(
        lines.contains(&"[0] p0 #7: say \"hi\"\t7".to_owned()),
        "{lines:?}"
    );
}

#[test]
fn logs_written_to_a_pipe_carry_no_colour_escapes() {
    let (lines, logs) = run_child("logs");
    check(&lines, |partition, index| {
        format!("{:?}", row(partition, index))
    });
    assert!(logs.contains("starting actors"), "the child logs: {logs}");
    assert!(!logs.contains('\x1b'), "escape codes in a pipe: {logs:?}");
}
