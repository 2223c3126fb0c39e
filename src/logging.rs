//! Logs for programs built on rtflow: [`init`] installs a `tracing`
//! subscriber that writes to standard error, filtered by `RUST_LOG`, in colour
//! only where a person reads it. A log written to a file or a pipe carries no
//! escape codes, so `grep` and log shippers read it as it is.

use std::io::IsTerminal;

/// Installs the logger: `RUST_LOG` filters it (`default_filter` when unset,
/// e.g. `"warn"` or `"rtflow_runtime=info"`); colour only when standard error
/// is a terminal and `NO_COLOR` is unset or empty. Does nothing if the
/// program installed a subscriber already.
///
/// ```
/// rtflow::logging::init("warn");
/// tracing::warn!("seen on stderr, without escape codes when redirected");
/// ```
pub fn init(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let colour = in_colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .try_init();
}

/// Whether to write escape codes: to a terminal, unless `NO_COLOR` is set to
/// anything but the empty string (<https://no-color.org>).
fn in_colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|value| value.is_empty())
}

#[cfg(test)]
mod tests {
    use super::in_colour;
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(in_colour(true, None));
        assert!(in_colour(true, Some(OsStr::new(""))));
        assert!(!in_colour(true, Some(OsStr::new("1"))));
        assert!(!in_colour(false, None));
        assert!(!in_colour(false, Some(OsStr::new(""))));
    }
}
