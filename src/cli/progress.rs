//! Progress of a build (`ejc build`, the candidates `ejc tune` compiles): on a terminal,
//! one bar per target with counts, rate and ETA (indicatif); elsewhere (a log, CI), a
//! line per target and one every 100 kernels, so that logs stay readable.

use std::io::IsTerminal;
use std::time::Instant;

use ejc_codegen::Progress;
use indicatif::{ProgressBar, ProgressStyle};

pub struct BuildProgress {
    quiet: bool,
    /// Off a terminal, log lines (else nothing).
    lines: bool,
    tty: bool,
    bar: Option<ProgressBar>,
    target: String,
    started: Instant,
}

impl BuildProgress {
    /// Nothing at all when `quiet`.
    pub fn new(quiet: bool) -> BuildProgress {
        BuildProgress {
            quiet,
            lines: true,
            tty: std::io::stderr().is_terminal(),
            bar: None,
            target: String::new(),
            started: Instant::now(),
        }
    }

    /// A bar on a terminal, nothing elsewhere (for commands that say what they build
    /// in their own words, like `ejc tune`).
    pub fn bars_only() -> BuildProgress {
        BuildProgress { lines: false, ..BuildProgress::new(false) }
    }

    pub fn event(&mut self, p: Progress) {
        if self.quiet {
            return;
        }
        match p {
            Progress::Start { kernels, targets } if self.lines => {
                eprintln!("building {kernels} kernels for {targets} target(s)")
            }
            Progress::Start { .. } => {}
            Progress::Target { target, total } => {
                self.finish_target();
                self.target = target.to_string();
                self.started = Instant::now();
                if self.tty {
                    let bar = ProgressBar::new(total as u64);
                    bar.set_style(
                        ProgressStyle::with_template(
                            "{prefix:>12} [{bar:30}] {pos}/{len} {elapsed:>4} ETA {eta:>4}  {wide_msg}",
                        )
                        .unwrap_or_else(|_| ProgressStyle::default_bar())
                        .progress_chars("=> "),
                    );
                    bar.set_prefix(self.target.clone());
                    self.bar = Some(bar);
                } else if self.lines {
                    eprintln!("  {target}: {total} to compile");
                }
            }
            Progress::Kernel { done, total, id } => match &self.bar {
                Some(bar) => {
                    bar.set_position(done as u64 + 1);
                    bar.set_message(id.to_string());
                }
                None if self.lines && done > 0 && done % 100 == 0 => eprintln!("  {}: {done}/{total}", self.target),
                None => {}
            },
            Progress::Finished => self.finish_target(),
        }
    }

    fn finish_target(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
            if !self.lines {
                return;
            }
            eprintln!(
                "  {}: {} in {:.1}s",
                self.target,
                bar.length().unwrap_or(0),
                self.started.elapsed().as_secs_f64()
            );
        }
    }
}
