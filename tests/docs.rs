//! The reference pages stay true to the code: every error class has a
//! section in docs/reference/errors.md, every metric family a live
//! `/metrics` serves is in docs/reference/metrics.md with its type, every
//! builder option is in docs/reference/configuration.md, and every relative
//! link of the README and docs/ leads to a file and heading that exist.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{checkpointed, TIMEOUT};
use rtflow::prelude::*;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: impl AsRef<Path>) -> String {
    let path = root().join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The `.rs` files under `dir`, recursively.
fn rust_files(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

/// The string literals returned by every `fn error_class` in `source`: the
/// literals between the function's first line and the closing brace at its
/// indentation.
fn error_classes_in(source: &str) -> Vec<String> {
    let mut classes = Vec::new();
    let mut lines = source.lines();
    while let Some(line) = lines.next() {
        if !line.contains("fn error_class(") {
            continue;
        }
        let indent = &line[..line.len() - line.trim_start().len()];
        let end = format!("{indent}}}");
        for line in lines.by_ref() {
            if line == end {
                break;
            }
            let mut rest = line;
            while let Some(open) = rest.find('"') {
                let after = &rest[open + 1..];
                let close = after.find('"').expect("a closed string literal");
                classes.push(after[..close].to_owned());
                rest = &after[close + 1..];
            }
        }
    }
    classes
}

#[test]
fn every_error_class_has_a_section_in_errors_md() {
    let mut files = Vec::new();
    for dir in [
        "runtime/src",
        "connectors/src",
        "operators/src",
        "checkpoint/src",
        "src",
    ] {
        rust_files(&root().join(dir), &mut files);
    }
    let mut classes = BTreeSet::new();
    for file in &files {
        let source = std::fs::read_to_string(file).unwrap();
        classes.extend(error_classes_in(&source));
    }
    assert!(
        classes.len() >= 24,
        "found only {} error classes in the code: {classes:?}",
        classes.len()
    );
    for class in &classes {
        assert!(
            class
                .chars()
                .all(|c| c.is_ascii_uppercase() || c == '_' || c == '.'),
            "not an error class: {class:?}"
        );
    }
    // The classes of the public API agree with what was parsed.
    assert!(classes.contains(RtflowError::CheckpointLocationRequired.error_class()));
    assert!(classes.contains(
        RtflowError::OutputModeNotSupported {
            mode: "Append".into()
        }
        .error_class()
    ));

    let doc = read("docs/reference/errors.md");
    let documented: BTreeSet<String> = doc
        .lines()
        .filter_map(|line| line.strip_prefix("### `")?.strip_suffix('`'))
        .map(str::to_owned)
        .collect();
    let missing: Vec<_> = classes.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "error classes without a section (### `CLASS`) in docs/reference/errors.md: {missing:?}"
    );
    let stale: Vec<_> = documented.difference(&classes).collect();
    assert!(
        stale.is_empty(),
        "docs/reference/errors.md documents classes the code does not have: {stale:?}"
    );
}

/// A documented metric family: its type and when it is served.
struct Documented {
    kind: String,
    when: String,
}

/// The rows of docs/reference/metrics.md's table, by family name.
fn documented_metrics() -> BTreeMap<String, Documented> {
    let doc = read("docs/reference/metrics.md");
    let mut families = BTreeMap::new();
    for line in doc.lines().filter(|l| l.starts_with("| `rtflow_")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // "", name, type, labels, when, what, ""
        assert!(cells.len() >= 6, "a metrics row with too few cells: {line}");
        let name = cells[1].trim_matches('`').to_owned();
        let previous = families.insert(
            name.clone(),
            Documented {
                kind: cells[2].to_owned(),
                when: cells[4].to_owned(),
            },
        );
        assert!(previous.is_none(), "{name} is documented twice");
    }
    assert!(!families.is_empty(), "no metrics table in metrics.md");
    families
}

/// GET /metrics: the body.
fn scrape(address: SocketAddr) -> String {
    let mut stream = TcpStream::connect(address).unwrap();
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.contains(" 200"), "{head}");
    body.to_owned()
}

/// The families of a scrape, by name, with their `# TYPE`.
fn families(body: &str) -> BTreeMap<String, String> {
    body.lines()
        .filter_map(|line| {
            let mut words = line.strip_prefix("# TYPE ")?.split_whitespace();
            Some((words.next()?.to_owned(), words.next()?.to_owned()))
        })
        .collect()
}

#[test]
fn metrics_md_matches_a_live_metrics_endpoint() {
    let documented = documented_metrics();
    let address = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();

    // A stateful query on event time with 100 ms checkpoints: it serves
    // every family a query without Kafka or a cluster can serve.
    let input = MemorySource::<(String, i64)>::new(2);
    let counts = MemorySink::new();
    let flow = Dataflow::new("documented");
    flow.source(input.clone())
        .with_watermark(|(_, time): &(String, i64)| *time, Duration::from_secs(1))
        .key_by(|(word, _): &(String, i64)| word.clone())
        .count()
        .sink(counts.clone());
    let query = flow
        .start(checkpointed("documented").metrics_address(address))
        .unwrap();

    let now_ms = || {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    };
    let expected: BTreeSet<&String> = documented
        .iter()
        .filter(|(_, d)| !d.when.contains("Kafka") && !d.when.contains("cluster"))
        .map(|(name, _)| name)
        .collect();
    let deadline = Instant::now() + TIMEOUT;
    let served = loop {
        for partition in 0..2 {
            input
                .push(partition, (format!("word-{partition}"), now_ms()))
                .unwrap();
        }
        let served = families(&scrape(address));
        if expected.iter().all(|name| served.contains_key(*name)) {
            break served;
        }
        assert!(
            Instant::now() < deadline,
            "documented families never served: {:?}",
            expected
                .iter()
                .filter(|name| !served.contains_key(**name))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    query.stop().unwrap();

    for (name, kind) in &served {
        let doc = documented
            .get(name)
            .unwrap_or_else(|| panic!("{name} ({kind}) is served but not in metrics.md"));
        assert_eq!(&doc.kind, kind, "{name}: metrics.md says {}", doc.kind);
    }
}

/// Every `pub fn name(mut self` of `file`: the builder options.
fn builder_options(file: &str) -> Vec<String> {
    read(file)
        .lines()
        .filter_map(|line| {
            let rest = line.trim_start().strip_prefix("pub fn ")?;
            let (name, args) = rest.split_once('(')?;
            let name = name.split('<').next()?;
            args.starts_with("mut self").then(|| name.to_owned())
        })
        .collect()
}

#[test]
fn configuration_md_names_every_option() {
    let doc = read("docs/reference/configuration.md");
    let mut missing = Vec::new();
    for (what, file) in [
        ("QueryConfig", "runtime/src/config.rs"),
        ("KafkaSource", "connectors/src/kafka/source.rs"),
        ("KafkaSink", "connectors/src/kafka/sink.rs"),
        ("KafkaCluster", "connectors/src/kafka/cluster/mod.rs"),
    ] {
        let options = builder_options(file);
        assert!(options.len() >= 4, "{file}: found only {options:?}");
        for option in options {
            if !doc.contains(&format!("`{option}(")) && !doc.contains(&format!("`{option}`")) {
                missing.push(format!("{what}::{option}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "options missing from docs/reference/configuration.md: {missing:?}"
    );
}

/// Every markdown file the links are checked in.
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, files: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, files);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    let mut files = vec![root().join("README.md"), root().join("CHANGELOG.md")];
    walk(&root().join("docs"), &mut files);
    files
}

/// The lines of `text` outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|line| {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// GitHub's anchors of the headings of `text`.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut anchors = BTreeSet::new();
    for line in prose(text) {
        let heading = line.trim_start_matches('#');
        if heading.len() == line.len() || !heading.starts_with(' ') {
            continue;
        }
        let slug: String = heading
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.entry(slug.clone()).or_default();
        anchors.insert(match *n {
            0 => slug.clone(),
            n => format!("{slug}-{n}"),
        });
        *n += 1;
    }
    anchors
}

/// The targets of the inline links `[text](target)` of `line`.
fn link_targets(line: &str) -> Vec<&str> {
    let mut targets = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        targets.push(&after[..end]);
        rest = &after[end..];
    }
    targets
}

#[test]
fn every_relative_link_in_the_docs_leads_somewhere() {
    let mut broken = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(root()).unwrap().display().to_string();
        for line in prose(&text) {
            // Inline code may hold `](` that is no link.
            let line: String = line.split('`').step_by(2).collect::<Vec<_>>().join("");
            for target in link_targets(&line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (path, anchor) = match target.split_once('#') {
                    Some((path, anchor)) => (path, Some(anchor)),
                    None => (target, None),
                };
                let linked = if path.is_empty() {
                    file.clone()
                } else {
                    file.parent().unwrap().join(path)
                };
                if !linked.exists() {
                    broken.push(format!("{name}: {target} (no such file)"));
                    continue;
                }
                if let Some(anchor) = anchor {
                    if linked.extension().is_some_and(|e| e == "md") {
                        let headings = anchors(&std::fs::read_to_string(&linked).unwrap());
                        if !headings.contains(anchor) {
                            broken.push(format!("{name}: {target} (no such heading)"));
                        }
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
