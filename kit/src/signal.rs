//! Process signals: sending them through `kill(2)` (no `kill` process is
//! spawned, so nothing depends on a `kill` binary or parses its exit
//! status), and, with the `shutdown` feature, waiting for the ones that
//! ask a binary to stop.

use std::fmt;
use std::str::FromStr;

use rustix::io::Errno;
use rustix::process::{Pid, kill_process, kill_process_group};

/// The signals tidegate's processes and tests send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Signal {
    /// SIGHUP: the gateway reloads its config.
    Hup,
    /// SIGINT: as Ctrl-C.
    Int,
    /// SIGKILL: ends the process at once; cannot be caught.
    Kill,
    /// SIGTERM: asks the process to drain and exit.
    Term,
    /// SIGSTOP: freezes the process; cannot be caught.
    Stop,
    /// SIGCONT: resumes a stopped process.
    Cont,
    /// SIGUSR1.
    Usr1,
    /// SIGUSR2.
    Usr2,
}

impl Signal {
    /// Every signal here, for parsing and tests.
    pub const ALL: [Signal; 8] = [
        Signal::Hup,
        Signal::Int,
        Signal::Kill,
        Signal::Term,
        Signal::Stop,
        Signal::Cont,
        Signal::Usr1,
        Signal::Usr2,
    ];

    /// The name `kill -s` takes: `TERM`, `KILL`, ...
    pub fn name(self) -> &'static str {
        match self {
            Signal::Hup => "HUP",
            Signal::Int => "INT",
            Signal::Kill => "KILL",
            Signal::Term => "TERM",
            Signal::Stop => "STOP",
            Signal::Cont => "CONT",
            Signal::Usr1 => "USR1",
            Signal::Usr2 => "USR2",
        }
    }

    fn raw(self) -> rustix::process::Signal {
        use rustix::process::Signal as S;
        match self {
            Signal::Hup => S::HUP,
            Signal::Int => S::INT,
            Signal::Kill => S::KILL,
            Signal::Term => S::TERM,
            Signal::Stop => S::STOP,
            Signal::Cont => S::CONT,
            Signal::Usr1 => S::USR1,
            Signal::Usr2 => S::USR2,
        }
    }
}

impl fmt::Display for Signal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SIG{}", self.name())
    }
}

/// A signal name that [`Signal`] does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown signal '{0}'; give one of HUP, INT, KILL, TERM, STOP, CONT, USR1, USR2")]
pub struct UnknownSignal(pub String);

impl FromStr for Signal {
    type Err = UnknownSignal;

    /// As `kill -s` takes it: `TERM`, `SIGTERM`, `term`, or `-TERM`.
    fn from_str(s: &str) -> Result<Signal, UnknownSignal> {
        let upper = s.trim().trim_start_matches('-').to_ascii_uppercase();
        let name = upper.strip_prefix("SIG").unwrap_or(&upper);
        Signal::ALL
            .into_iter()
            .find(|sig| sig.name() == name)
            .ok_or_else(|| UnknownSignal(s.to_string()))
    }
}

/// Why a signal was not sent.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SignalError {
    /// The pid is 0, 1 or beyond `i32::MAX`: `kill(2)` would signal the
    /// caller's own process group, init, or a process group; refused.
    #[error("refusing to send {signal} to pid {pid}: not a process tidegate started")]
    BadPid {
        /// The pid asked for.
        pid: u32,
        /// The signal.
        signal: Signal,
    },
    /// No such process (or group): it has exited and been reaped.
    #[error("cannot send {signal} to pid {pid}: no such process; has it exited already?")]
    NoProcess {
        /// The pid.
        pid: u32,
        /// The signal.
        signal: Signal,
    },
    /// The process belongs to someone this process may not signal.
    #[error("not permitted to send {signal} to pid {pid}: it is another user's process")]
    NotPermitted {
        /// The pid.
        pid: u32,
        /// The signal.
        signal: Signal,
    },
    /// `kill(2)` failed otherwise.
    #[error("sending {signal} to pid {pid}: {source}")]
    Failed {
        /// The pid.
        pid: u32,
        /// The signal.
        signal: Signal,
        /// The system's error.
        source: std::io::Error,
    },
}

impl SignalError {
    /// Whether the process was already gone.
    pub fn is_gone(&self) -> bool {
        matches!(self, SignalError::NoProcess { .. })
    }
}

/// Sends `signal` to the process `pid`.
pub fn send(pid: u32, signal: Signal) -> Result<(), SignalError> {
    let target = target(pid, signal)?;
    kill_process(target, signal.raw()).map_err(|e| error(pid, signal, e))
}

/// Sends `signal` to every process of the process group `pgid` (a child
/// started as the leader of its own group, and what it started).
pub fn send_group(pgid: u32, signal: Signal) -> Result<(), SignalError> {
    let target = target(pgid, signal)?;
    kill_process_group(target, signal.raw()).map_err(|e| error(pgid, signal, e))
}

/// Sends SIGTERM to `pid`: asks it to drain and exit.
pub fn terminate(pid: u32) -> Result<(), SignalError> {
    send(pid, Signal::Term)
}

fn target(pid: u32, signal: Signal) -> Result<Pid, SignalError> {
    i32::try_from(pid)
        .ok()
        .filter(|&raw| raw > 1)
        .and_then(Pid::from_raw)
        .ok_or(SignalError::BadPid { pid, signal })
}

fn error(pid: u32, signal: Signal, e: Errno) -> SignalError {
    match e {
        Errno::SRCH => SignalError::NoProcess { pid, signal },
        Errno::PERM => SignalError::NotPermitted { pid, signal },
        e => SignalError::Failed {
            pid,
            signal,
            source: e.into(),
        },
    }
}

/// Returns when this process is asked to stop: SIGTERM or Ctrl-C
/// (SIGINT). The binaries hand it to their run loops, which then drain.
///
/// The handlers are installed when it is first polled: a process that
/// announces it is ready to be stopped should take [`Stop::install`] first.
///
/// # Panics
///
/// When the SIGTERM handler cannot be installed (no signal driver in the
/// tokio runtime: build it with `enable_all`).
#[cfg(feature = "shutdown")]
pub async fn shutdown() {
    Stop::install()
        .expect("installing the SIGTERM and SIGINT handlers")
        .wait()
        .await
}

/// SIGTERM and SIGINT caught from the moment it is made: a signal sent
/// before [`Stop::wait`] is polled is not lost, nor does it kill the
/// process by its default action.
#[cfg(feature = "shutdown")]
#[derive(Debug)]
pub struct Stop {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

#[cfg(feature = "shutdown")]
impl Stop {
    /// Installs the handlers. Must run inside a tokio runtime with its
    /// signal driver (`enable_all`).
    pub fn install() -> std::io::Result<Stop> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Stop {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// Returns at the first SIGTERM or SIGINT since [`Stop::install`].
    pub async fn wait(mut self) {
        tokio::select! {
            _ = self.term.recv() => {},
            _ = self.int.recv() => {},
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    /// A child that sleeps until signalled (bounded: 30 s at most).
    fn sleeper() -> std::process::Child {
        Command::new("sleep")
            .arg("30")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawning sleep")
    }

    /// Waits at most 10 s for `child` to exit.
    fn exit_signal(child: &mut std::process::Child) -> Option<i32> {
        use std::os::unix::process::ExitStatusExt;
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if let Some(status) = child.try_wait().unwrap() {
                return status.signal();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    #[test]
    fn terminate_ends_a_child_by_sigterm_and_a_reaped_one_is_named_gone() {
        let mut child = sleeper();
        let pid = child.id();
        terminate(pid).unwrap();
        assert_eq!(exit_signal(&mut child), Some(15));
        let err = send(pid, Signal::Kill).unwrap_err();
        assert!(err.is_gone(), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains(&format!("pid {pid}")) && text.contains("SIGKILL"),
            "{text}"
        );
    }

    #[test]
    fn kill_ends_a_child_by_sigkill() {
        let mut child = sleeper();
        send(child.id(), Signal::Kill).unwrap();
        assert_eq!(exit_signal(&mut child), Some(9));
    }

    #[test]
    fn a_signal_to_a_group_reaches_its_members() {
        use std::os::unix::process::CommandExt;
        let mut child = Command::new("sleep")
            .arg("30")
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap();
        send_group(child.id(), Signal::Term).unwrap();
        assert_eq!(exit_signal(&mut child), Some(15));
    }

    #[test]
    fn pids_that_would_signal_a_group_init_or_ourselves_are_refused() {
        for pid in [0, 1, u32::MAX, i32::MAX as u32 + 1] {
            for sig in Signal::ALL {
                let err = send(pid, sig).unwrap_err();
                assert!(matches!(err, SignalError::BadPid { .. }), "{pid}: {err:?}");
                assert!(err.to_string().contains(&format!("pid {pid}")), "{err}");
                let err = send_group(pid, sig).unwrap_err();
                assert!(matches!(err, SignalError::BadPid { .. }), "{pid}: {err:?}");
            }
        }
    }

    #[test]
    fn signal_names_parse_as_kill_takes_them_and_an_unknown_one_is_named() {
        for sig in Signal::ALL {
            for text in [
                sig.name().to_string(),
                format!("SIG{}", sig.name()),
                format!("-{}", sig.name()),
                sig.name().to_ascii_lowercase(),
            ] {
                assert_eq!(text.parse::<Signal>(), Ok(sig), "{text}");
            }
            assert_eq!(sig.to_string(), format!("SIG{}", sig.name()));
        }
        let err = "TREM".parse::<Signal>().unwrap_err();
        assert!(err.to_string().contains("'TREM'"), "{err}");
        assert!("".parse::<Signal>().is_err());
    }

    #[cfg(feature = "shutdown")]
    #[tokio::test]
    async fn shutdown_waits_until_sigterm_arrives() {
        use tokio::signal::unix::{SignalKind, signal};
        // Installed first, so that no SIGTERM below can end the test
        // process by its default action.
        let _held = signal(SignalKind::terminate()).unwrap();
        let waiting = tokio::spawn(shutdown());
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "returned before any signal");
        // Bounded: 200 tries, 5 ms apart.
        for _ in 0..200 {
            terminate(std::process::id()).unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
            if waiting.is_finished() {
                break;
            }
        }
        assert!(waiting.is_finished(), "still waiting after SIGTERMs");
        waiting.await.unwrap();
    }
}
