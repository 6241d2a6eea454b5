//! Log output: a [`tracing`] subscriber that writes every enabled event as
//! one line (`LEVEL target: message key=value ...`) to a sink (standard
//! error for the programs; memory in tests), filtered by `RUST_LOG`-style
//! directives.
//!
//! Directives are comma-separated: `level` sets the default, and
//! `target=level` the level of every target that starts with `target`
//! (the longest match wins). Levels: `off`, `error`, `warn`, `info`,
//! `debug`, `trace`. The default is `warn`: refused connections, failed
//! refits and other events an operator must see are printed; progress is
//! not.

use std::fmt::{self, Write as _};
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::{span, Event, Level, Metadata, Subscriber};

/// The variable [`Logger::from_env`] reads.
pub const LOG_ENV: &str = "RUST_LOG";

/// Which events pass: a default level and per-target levels.
#[derive(Debug, Clone, PartialEq)]
pub struct LogFilter {
    default: LevelFilter,
    /// `(target prefix, level)`, longest prefix first.
    targets: Vec<(String, LevelFilter)>,
}

impl Default for LogFilter {
    fn default() -> Self {
        LogFilter { default: LevelFilter::WARN, targets: Vec::new() }
    }
}

fn level(text: &str) -> Option<LevelFilter> {
    Some(match text.trim().to_ascii_lowercase().as_str() {
        "off" => LevelFilter::OFF,
        "error" => LevelFilter::ERROR,
        "warn" => LevelFilter::WARN,
        "info" => LevelFilter::INFO,
        "debug" => LevelFilter::DEBUG,
        "trace" => LevelFilter::TRACE,
        _ => return None,
    })
}

impl LogFilter {
    /// Parses directives (`warn`, `transport=debug,info`); an empty string
    /// is the default. A directive that is not understood is an error
    /// naming it.
    pub fn parse(directives: &str) -> Result<LogFilter, String> {
        let mut filter = LogFilter::default();
        for directive in directives.split(',').map(str::trim).filter(|d| !d.is_empty()) {
            let bad = || format!("{LOG_ENV}: '{directive}' is not a level (off, error, warn, info, debug, trace) or target=level");
            match directive.split_once('=') {
                Some((target, lvl)) if !target.trim().is_empty() => {
                    filter.targets.push((target.trim().to_string(), level(lvl).ok_or_else(bad)?));
                }
                Some(_) => return Err(bad()),
                None => filter.default = level(directive).ok_or_else(bad)?,
            }
        }
        filter.targets.sort_by_key(|(t, _)| std::cmp::Reverse(t.len()));
        Ok(filter)
    }

    /// Whether an event of `level` from `target` passes.
    pub fn enabled(&self, target: &str, level: &Level) -> bool {
        let limit = self.targets.iter().find(|(t, _)| target.starts_with(t.as_str())).map_or(self.default, |(_, l)| *l);
        limit >= *level
    }

    fn max(&self) -> LevelFilter {
        self.targets.iter().map(|(_, l)| *l).fold(self.default, std::cmp::max)
    }
}

/// A subscriber that writes enabled events as lines to its sink.
pub struct Logger {
    filter: LogFilter,
    sink: Mutex<Box<dyn Write + Send>>,
    spans: AtomicU64,
}

impl Logger {
    /// A logger writing to `sink`.
    pub fn new(filter: LogFilter, sink: Box<dyn Write + Send>) -> Logger {
        Logger { filter, sink: Mutex::new(sink), spans: AtomicU64::new(0) }
    }

    /// A logger to standard error, filtered by `RUST_LOG` (the default if
    /// unset; an error naming the directive if it cannot be read).
    pub fn from_env() -> Result<Logger, String> {
        let filter = match std::env::var(LOG_ENV) {
            Ok(text) => LogFilter::parse(&text)?,
            Err(std::env::VarError::NotPresent) => LogFilter::default(),
            Err(std::env::VarError::NotUnicode(_)) => return Err(format!("{LOG_ENV} is not UTF-8")),
        };
        Ok(Logger::new(filter, Box::new(std::io::stderr())))
    }

    /// Makes this the process's subscriber; `false` if one was already set.
    pub fn install(self) -> bool {
        tracing::subscriber::set_global_default(self).is_ok()
    }
}

/// Collects an event's message and fields into one line.
struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, " {value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            let _ = write!(self.0, " {value}");
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }
}

impl Subscriber for Logger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        self.filter.enabled(metadata.target(), metadata.level())
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.filter.max())
    }

    fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
        // Spans are not printed; ids only have to be distinct and non-zero.
        span::Id::from_u64(self.spans.fetch_add(1, Ordering::Relaxed) + 1)
    }

    fn record(&self, _: &span::Id, _: &span::Record<'_>) {}

    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}

    fn event(&self, event: &Event<'_>) {
        let meta = event.metadata();
        let mut line = Line(format!("{} {}:", meta.level(), meta.target()));
        event.record(&mut line);
        line.0.push('\n');
        // A poisoned sink still takes lines; a failed write is dropped (a
        // log line must never fail what it describes).
        let mut sink = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        let _ = sink.write_all(line.0.as_bytes());
    }

    fn enter(&self, _: &span::Id) {}

    fn exit(&self, _: &span::Id) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives_pick_the_longest_matching_target() {
        let f = LogFilter::parse("info, transport=debug, transport::tcp=error").unwrap();
        assert!(f.enabled("actors::remote", &Level::INFO));
        assert!(!f.enabled("actors::remote", &Level::DEBUG));
        assert!(f.enabled("transport::node", &Level::DEBUG));
        assert!(!f.enabled("transport::tcp", &Level::WARN));
        assert!(f.enabled("transport::tcp", &Level::ERROR));
        assert_eq!(f.max(), LevelFilter::DEBUG);
        let d = LogFilter::parse("").unwrap();
        assert!(d.enabled("x", &Level::WARN) && !d.enabled("x", &Level::INFO));
        assert!(!LogFilter::parse("off").unwrap().enabled("x", &Level::ERROR));
    }

    #[test]
    fn bad_directives_are_named() {
        for bad in ["loud", "x=loud", "=info"] {
            let e = LogFilter::parse(bad).unwrap_err();
            assert!(e.contains(&format!("'{bad}'")), "{e}");
        }
    }

    #[derive(Clone, Default)]
    struct Memory(std::sync::Arc<Mutex<Vec<u8>>>);

    impl Write for Memory {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn events_become_lines_with_their_fields() {
        let memory = Memory::default();
        let logger = Logger::new(LogFilter::parse("warn").unwrap(), Box::new(memory.clone()));
        tracing::subscriber::with_default(logger, || {
            let peer = "10.0.0.1:9";
            tracing::warn!(%peer, reason = "no handshake", "rejected connection");
            tracing::info!("not shown");
        });
        let text = String::from_utf8(memory.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text, "WARN actors::log::tests: rejected connection peer=10.0.0.1:9 reason=no handshake\n");
    }
}
