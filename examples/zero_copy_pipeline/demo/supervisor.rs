//! The parent: starts the three stage processes, hands each its channels, watches their
//! control sockets, reaps them all (killing those still running after a failure, at the
//! timeout, or when `run` itself fails) and puts their figures together.

use std::collections::VecDeque;
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dmabuf_rt::Error;
use dmabuf_rt::share::Channel;
use rustix::io::Errno;

use super::options::{Mode, Options, Stage};
use super::report::{Comparison, Report, StageOutcome};
use super::stats::StageStats;
use super::{PipelineError, Result};

/// Size asked of each pipe of the baseline (`F_SETPIPE_SZ`; 1 MiB is the unprivileged limit).
const PIPE_SIZE: usize = 1 << 20;
/// How long the other stages get to exit on their own after one has failed.
const GRACE: Duration = Duration::from_secs(10);
/// Bytes of a stage's stderr kept for the error report.
const STDERR_TAIL: usize = 2048;

/// Runs one pipeline: starts the three stages by running `stage_exe` with
/// `stage_args_prefix` followed by the role arguments (which begin with [`STAGE_FLAG`](super::STAGE_FLAG)),
/// supervises them, reaps them all and returns the figures, or the error of the stage that
/// failed. Nothing outlives the call: every stage is reaped, killed first if need be. (The
/// stages also die with the thread that called `run`: they ask for `PR_SET_PDEATHSIG`.)
pub fn run(opts: &Options, stage_exe: &Path, stage_args_prefix: &[&str]) -> Result<Report> {
    opts.validate()?;
    if opts.mode == Mode::ZeroCopy {
        // A missing or forbidden device is the caller's error, not a stage's.
        opts.source.probe()?;
    }
    let links = links(opts.mode)?;
    let mut sup = Supervisor { stages: Vec::with_capacity(3) };
    for (stage, fds) in Stage::ALL.into_iter().zip(links) {
        sup.start(stage, opts, stage_exe, stage_args_prefix, fds)?;
        // `fds` (this process's copies of the stage's ends) are closed here, so that when a
        // stage dies its peers see the hang-up.
    }
    sup.supervise(opts)
}

/// Runs the zero-copy pipeline, then the pipes baseline, with the same options.
pub fn compare(opts: &Options, stage_exe: &Path, stage_args_prefix: &[&str]) -> Result<Comparison> {
    let zero_copy = run(&Options { mode: Mode::ZeroCopy, ..opts.clone() }, stage_exe, stage_args_prefix)?;
    let pipes = run(&Options { mode: Mode::Pipes, ..opts.clone() }, stage_exe, stage_args_prefix)?;
    Ok(Comparison { zero_copy, pipes })
}

/// The two data fds of each stage, in `Stage::ALL` order: producer (out, return), transform
/// (in, out), consumer (in, return).
fn links(mode: Mode) -> Result<[[OwnedFd; 2]; 3]> {
    let (c_ret, p_ret) = seqpacket_pair()?;
    let (p_out, t_in, t_out, c_in) = match mode {
        Mode::ZeroCopy => {
            let (p_out, t_in) = seqpacket_pair()?;
            let (t_out, c_in) = seqpacket_pair()?;
            (p_out, t_in, t_out, c_in)
        }
        Mode::Pipes => {
            let (t_in, p_out) = pipe()?;
            let (c_in, t_out) = pipe()?;
            (p_out, t_in, t_out, c_in)
        }
    };
    Ok([[p_out, p_ret], [t_in, t_out], [c_in, c_ret]])
}

fn seqpacket_pair() -> Result<(OwnedFd, OwnedFd)> {
    let (a, b) = Channel::pair("link")?;
    Ok((a.into_fd(), b.into_fd()))
}

/// A close-on-exec pipe (read end, write end), enlarged to [`PIPE_SIZE`] where allowed.
fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| PipelineError::Io { op: "pipe2".into(), source: e.into() })?;
    // Best effort: a bigger pipe only makes the baseline faster.
    let _ = rustix::pipe::fcntl_setpipe_size(&w, PIPE_SIZE);
    Ok((r, w))
}

/// One stage process as the parent sees it.
struct Running {
    stage: Stage,
    child: Child,
    /// The parent's end of the stage's control socket.
    ctl: Channel,
    stderr: Option<JoinHandle<String>>,
    stderr_tail: String,
    stats: Option<StageStats>,
    error: Option<(bool, String)>,
    status: Option<ExitStatus>,
    killed: bool,
    /// When it was reaped, in order (0 first).
    order: usize,
}

impl Running {
    fn kill_and_reap(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            self.killed = true;
            self.status = self.child.wait().ok().or(Some(ExitStatus::from_raw(9)));
        }
        self.join_stderr();
    }

    fn join_stderr(&mut self) {
        if let Some(h) = self.stderr.take() {
            self.stderr_tail = h.join().unwrap_or_default();
        }
    }

    fn failed(&self) -> bool {
        self.status.is_some() && !self.outcome().succeeded()
    }

    fn outcome(&self) -> StageOutcome {
        let status = self.status.unwrap_or(ExitStatus::from_raw(0));
        StageOutcome {
            stage: self.stage,
            pid: self.child.id(),
            code: status.code(),
            signal: status.signal(),
            killed_by_parent: self.killed,
            error: self.error.as_ref().map(|(_, e)| e.clone()),
            peer_gone: self.error.as_ref().is_some_and(|(gone, _)| *gone),
            reported: self.stats.is_some(),
            stderr: self.stderr_tail.clone(),
        }
    }

    /// Reads one control message, or on end-of-file reaps the stage.
    fn read_control(&mut self, reaped: &mut usize) {
        let mut buf = [0u8; 4096];
        match self.ctl.recv_bytes(&mut buf) {
            Ok((len, _fds)) => {
                let text = String::from_utf8_lossy(&buf[..len]);
                if let Some(rest) = text.strip_prefix("failed ") {
                    let (gone, msg) = rest.split_once(' ').unwrap_or((rest, ""));
                    self.error = Some((gone == "peer_gone=1", msg.to_string()));
                } else if let Some(stats) = StageStats::parse(&text) {
                    self.stats = Some(stats);
                } else {
                    self.error = Some((false, format!("unintelligible report `{text}`")));
                }
            }
            Err(Error::Protocol { why, .. }) => self.error = Some((false, format!("unintelligible report: {why}"))),
            // End of file (or a reset from a crashed stage): the stage has exited.
            Err(_) => {
                self.status = Some(self.child.wait().unwrap_or(ExitStatus::from_raw(1 << 8)));
                self.order = *reaped;
                *reaped += 1;
                self.join_stderr();
            }
        }
    }
}

/// Owns the stage processes; dropping it kills and reaps any still running.
struct Supervisor {
    stages: Vec<Running>,
}

impl Supervisor {
    fn start(&mut self, stage: Stage, opts: &Options, exe: &Path, prefix: &[&str], fds: [OwnedFd; 2]) -> Result<()> {
        let (ctl, child_ctl) = Channel::pair(&format!("{stage} control"))?;
        // The control socket becomes the stage's stdin: std installs it as fd 0 in the child
        // only, so no other process (another thread's child) can inherit it.
        let mut child = Command::new(exe)
            .args(prefix)
            .args(opts.stage_args(stage))
            .stdin(Stdio::from(child_ctl.into_fd()))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| PipelineError::Spawn { stage, exe: exe.to_path_buf(), source })?;
        let stderr = child.stderr.take().map(|mut e| std::thread::spawn(move || tail(&mut e)));
        self.stages.push(Running {
            stage,
            child,
            ctl,
            stderr,
            stderr_tail: String::new(),
            stats: None,
            error: None,
            status: None,
            killed: false,
            order: usize::MAX,
        });
        let setup = format!("setup parent={}", std::process::id());
        let ctl = &self.stages.last().expect("just pushed").ctl;
        ctl.send_bytes(setup.as_bytes(), &[fds[0].as_fd(), fds[1].as_fd()])?;
        Ok(())
    }

    fn supervise(mut self, opts: &Options) -> Result<Report> {
        let deadline = Instant::now() + opts.timeout;
        let mut grace_end: Option<Instant> = None;
        let mut reaped = 0;
        let mut timed_out = false;
        loop {
            let live: Vec<usize> = (0..self.stages.len()).filter(|&i| self.stages[i].status.is_none()).collect();
            if live.is_empty() {
                break;
            }
            let now = Instant::now();
            let limit = grace_end.map_or(deadline, |g| g.min(deadline));
            if now >= limit {
                timed_out = grace_end.is_none();
                for &i in &live {
                    self.stages[i].kill_and_reap();
                }
                break;
            }
            let wait = limit - now;
            let ts = rustix::event::Timespec { tv_sec: wait.as_secs() as i64, tv_nsec: wait.subsec_nanos() as i64 };
            let ready: Vec<usize> = {
                use rustix::event::{PollFd, PollFlags};
                let mut pfds: Vec<PollFd<'_>> =
                    live.iter().map(|&i| PollFd::new(&self.stages[i].ctl, PollFlags::IN)).collect();
                match rustix::event::poll(&mut pfds, Some(&ts)) {
                    Ok(_) | Err(Errno::INTR) => {}
                    Err(e) => {
                        return Err(PipelineError::Io {
                            op: "poll the stages' control sockets".into(),
                            source: e.into(),
                        });
                    }
                }
                live.iter().zip(&pfds).filter(|(_, p)| !p.revents().is_empty()).map(|(&i, _)| i).collect()
            };
            for i in ready {
                self.stages[i].read_control(&mut reaped);
            }
            if grace_end.is_none() && self.stages.iter().any(Running::failed) {
                grace_end = Some(Instant::now() + GRACE);
            }
        }
        let outcomes: Vec<StageOutcome> = self.stages.iter().map(Running::outcome).collect();
        if timed_out {
            return Err(PipelineError::Timeout { waited: opts.timeout, outcomes });
        }
        if outcomes.iter().all(StageOutcome::succeeded) {
            let stats: Vec<&StageStats> = self.stages.iter().filter_map(|s| s.stats.as_ref()).collect();
            return Ok(report(opts, &stats));
        }
        // The stage to blame: the first reaped that failed for a reason of its own (a crash, an
        // error other than a hang-up), else the first that failed at all.
        let mut failed: Vec<&Running> = self.stages.iter().filter(|s| !s.outcome().succeeded()).collect();
        failed.sort_by_key(|s| {
            let o = s.outcome();
            (o.killed_by_parent, o.peer_gone, s.order)
        });
        let stage = failed.first().map_or(Stage::Producer, |s| s.stage);
        Err(PipelineError::Stage { stage, outcomes })
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        for s in &mut self.stages {
            s.kill_and_reap();
        }
    }
}

fn report(opts: &Options, stats: &[&StageStats]) -> Report {
    let producer = stats[0];
    let consumer = stats[2];
    let seconds = (producer.elapsed_ns as f64 / 1e9).max(1e-9);
    let frames = consumer.frames;
    Report {
        mode: opts.mode,
        source: opts.source.clone(),
        source_name: producer.source_name.clone(),
        frames,
        frame_size: opts.frame_size,
        pool_size: opts.pool_size,
        seconds,
        frames_per_sec: frames as f64 / seconds,
        megabytes_per_sec: frames as f64 * opts.frame_size as f64 / seconds / 1e6,
        bytes_copied: stats.iter().map(|s| s.bytes_copied).sum(),
        control_bytes: stats.iter().map(|s| s.control_bytes).sum(),
        fds_passed: stats.iter().map(|s| s.fds_passed).sum(),
        buffers_allocated: producer.buffers,
        frames_verified: consumer.verified,
    }
}

/// The last [`STDERR_TAIL`] bytes of a stage's stderr.
fn tail(r: &mut impl Read) -> String {
    let mut keep: VecDeque<u8> = VecDeque::new();
    let mut buf = [0u8; 1024];
    loop {
        match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                keep.extend(&buf[..n]);
                while keep.len() > STDERR_TAIL {
                    keep.pop_front();
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    String::from_utf8_lossy(&Vec::from(keep)).into_owned()
}
