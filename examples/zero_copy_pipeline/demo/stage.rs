//! A stage process: receives its channels from the parent, plays its role (producer,
//! transform or consumer, zero-copy or through pipes), and reports its figures or its error.
//!
//! Zero-copy, the producer allocates each frame from a caching allocator and shares it with
//! both other stages by IPC handle ([`dmabuf_rt::ipc`]): the transform's handle and the
//! consumer's travel with the frame, the transform passes the consumer's on (a handle is
//! opened by the process it was made for; nothing is shared onward), and the block goes back
//! to the producer's allocator once both released it. The library checks each packet, fd and
//! handle; a stage checks what only the application knows (the frame due next, its length,
//! the number of frames).

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Instant;

use dmabuf_rt::caching::CachingAllocator;
use dmabuf_rt::ipc::{IpcExporter, IpcHandle, IpcImporter};
use dmabuf_rt::share::{Channel, Frame, Incoming, Ledger, PoolMessage};
use dmabuf_rt::{Access, Error, MemorySource};

use super::messages::{self, Message};
use super::options::{Fault, Mode, Options, Stage};
use super::pipes::{PipeIn, PipeOut};
use super::stats::StageStats;
use super::work::{
    produce_bytes, produce_in_place, transform_bytes, transform_in_place, verify_bytes, verify_in_place,
};
use super::{PipelineError, Result, io_err};

/// What [`Fault::Malformed`] sends instead of a message.
const GARBAGE: [u8; 32] = [0xa5; 32];

/// Acts as one stage, in a process [`run`](super::run) started: `args` are the role
/// arguments, from [`STAGE_FLAG`](super::STAGE_FLAG) on. Receives the stage's channels on the
/// control socket (fd 0), does its part, reports to the parent, and returns. An error here
/// means the process should exit non-zero ([`stage_process`] does that).
pub fn stage_main(args: &[String]) -> Result<()> {
    let (stage, opts) = Options::from_stage_args(args)?;
    let fd0 = io::stdin().as_fd().try_clone_to_owned().map_err(io_err("dup the control socket (fd 0)"))?;
    let ctl = Channel::from_fd(fd0, "control").map_err(|e| {
        PipelineError::NotAStage(format!(
            "{e}: stages are started by the pipeline demo's run(), which passes them their control socket as stdin"
        ))
    })?;
    let mut buf = [0u8; 256];
    let (len, fds) = match ctl.recv_bytes(&mut buf) {
        Ok(got) => got,
        Err(Error::PeerGone { .. }) => {
            return Err(PipelineError::NotAStage("the parent closed the control socket before the setup".into()));
        }
        Err(Error::Protocol { why, .. }) => return Err(PipelineError::NotAStage(format!("bad setup message: {why}"))),
        Err(e) => return Err(e.into()),
    };
    let text = String::from_utf8_lossy(&buf[..len]);
    let parent: i32 = text
        .strip_prefix("setup parent=")
        .and_then(|p| p.trim().parse().ok())
        .ok_or_else(|| PipelineError::NotAStage(format!("unexpected setup message `{text}`")))?;
    let [a, b]: [OwnedFd; 2] = fds
        .try_into()
        .map_err(|v: Vec<OwnedFd>| PipelineError::NotAStage(format!("setup carried {} fds, not 2", v.len())))?;
    // Die with the parent, so that no stage outlives a killed `run`. The check after it
    // covers a parent that died before the call.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    if rustix::process::getppid().map(|p| p.as_raw_nonzero().get()) != Some(parent) {
        return Err(PipelineError::NotAStage("the parent exited before the stage started".into()));
    }
    let result = run_stage(stage, &opts, a, b);
    let message = match &result {
        Ok(stats) => stats.to_message(),
        Err(e) => {
            let mut m = format!("failed peer_gone={} {e}", u8::from(e.peer_gone()));
            truncate_at_char(&mut m, 3000);
            m
        }
    };
    // If the parent is gone there is nobody to tell.
    let _ = ctl.send_bytes(message.as_bytes(), &[]);
    result.map(drop)
}

/// [`stage_main`] as a whole process: exits 0 when the stage did its part, else prints the
/// error on stderr and exits 1. For `main` functions: `if args[0] == STAGE_FLAG {
/// stage_process(&args) }`.
pub fn stage_process(args: &[String]) -> ! {
    match stage_main(args) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            let role = args.get(1).map_or("?", String::as_str);
            eprintln!("dmabuf-rt pipeline stage {role}: {e}");
            std::process::exit(1)
        }
    }
}

/// Cuts `s` to at most `max` bytes, at a character boundary.
fn truncate_at_char(s: &mut String, max: usize) {
    let mut i = max.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    s.truncate(i);
}

fn run_stage(stage: Stage, o: &Options, a: OwnedFd, b: OwnedFd) -> Result<StageStats> {
    let chan = |fd: OwnedFd, name: &str| Channel::from_fd(fd, name);
    let pipe_in = |fd: OwnedFd, name: &'static str| PipeIn::new(fd, name);
    let pipe_out = |fd: OwnedFd, name: &'static str| PipeOut::new(fd, name);
    match (o.mode, stage) {
        (Mode::ZeroCopy, Stage::Producer) => {
            producer_shared(o, chan(a, "producer->transform")?, chan(b, "consumer->producer")?)
        }
        (Mode::Pipes, Stage::Producer) => {
            producer_pipes(o, pipe_out(a, "producer->transform pipe"), chan(b, "consumer->producer")?)
        }
        (Mode::ZeroCopy, Stage::Transform) => {
            transform_shared(o, chan(a, "producer->transform")?, chan(b, "transform->consumer")?)
        }
        (Mode::Pipes, Stage::Transform) => {
            transform_pipes(o, pipe_in(a, "producer->transform pipe"), pipe_out(b, "transform->consumer pipe"))
        }
        (Mode::ZeroCopy, Stage::Consumer) => {
            consumer_shared(o, chan(a, "transform->consumer")?, chan(b, "consumer->producer")?)
        }
        (Mode::Pipes, Stage::Consumer) => {
            consumer_pipes(o, pipe_in(a, "transform->consumer pipe"), chan(b, "consumer->producer")?)
        }
    }
}

/// Crashes here if the fault says so: no core dump, no destructors, like a real crash.
fn crash_point(o: &Options, stage: Stage, frames_done: u64) {
    if o.fault == Some(Fault::Crash { stage, after: frames_done }) {
        let _ = rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable);
        std::process::abort();
    }
}

fn malformed_now(o: &Options, stage: Stage, frames_done: u64) -> bool {
    o.fault == Some(Fault::Malformed { stage, after: frames_done })
}

fn protocol(channel: &str, why: String) -> PipelineError {
    PipelineError::Share(Error::Protocol { channel: channel.into(), why })
}

/// What only the pipeline knows: frame `seq` is due (or, after the last, the end), with
/// the frame size of the options.
fn due(o: &Options, seq: u64, incoming: Incoming, channel: &str) -> Result<Option<Frame>> {
    match incoming {
        Incoming::End { count } if count == seq && seq == o.frames => Ok(None),
        Incoming::End { count } => {
            Err(protocol(channel, format!("end of stream after {count} frames, but {seq} of {} arrived", o.frames)))
        }
        Incoming::Frame { frame, .. } if frame.seq != seq || seq >= o.frames => {
            Err(protocol(channel, format!("frame {} where frame {seq} of {} was due", frame.seq, o.frames)))
        }
        Incoming::Frame { frame, .. } if frame.len != o.frame_size as u64 => {
            Err(protocol(channel, format!("frame of {} bytes, expected {}", frame.len, o.frame_size)))
        }
        Incoming::Frame { frame, .. } => Ok(Some(frame)),
    }
}

/// The next frame from a pipe, read into `buf`, or `None` at the end.
fn next_piped(o: &Options, input: &mut PipeIn, buf: &mut [u8], seq: u64) -> Result<Option<Frame>> {
    let incoming = match input.header()? {
        PoolMessage::End { count } => Incoming::End { count },
        PoolMessage::Return { .. } => return Err(protocol(input.name, "a return message on a frame channel".into())),
        PoolMessage::Frame(f) if f.id as usize >= o.pool_size => {
            return Err(protocol(input.name, format!("buffer id {} outside the pool of {}", f.id, o.pool_size)));
        }
        PoolMessage::Frame(frame) => Incoming::Frame { frame, first: false },
    };
    let frame = due(o, seq, incoming, input.name)?;
    if frame.is_some() {
        input.read(buf)?;
    }
    Ok(frame)
}

/// The producer's frames: a caching allocator over the chosen source, whose blocks go to the
/// two other stages by IPC handle. Its memory: the frames in flight, and as many again for
/// blocks whose releases are still on their way back (a block returns to the allocator once
/// both stages released it, which the consumer's return may overtake).
fn frame_allocator(o: &Options, source: Box<dyn MemorySource>) -> Result<CachingAllocator> {
    let block = o.frame_size.next_multiple_of(2 << 20) as u64;
    let capacity = (2 * o.pool_size as u64 + 2) * block;
    Ok(CachingAllocator::builder_boxed(source).capacity(capacity).build()?)
}

/// An exporter to the stage at the other end of `app`: a new channel pair, one end of which
/// goes to the stage in a setup message.
fn exporter_to(app: &Channel, name: &str) -> Result<IpcExporter> {
    let (here, there) = Channel::pair(name)?;
    app.send_bytes(&Message::Setup.encode(), &[there.as_fd()])?;
    Ok(IpcExporter::new(here)?)
}

/// The importer the producer's setup message on `app` names.
fn importer_from(app: &Channel, name: &str) -> Result<IpcImporter> {
    match messages::recv(app)? {
        (Message::Setup, mut fds) => Ok(IpcImporter::new(Channel::from_fd(fds.remove(0), name)?)),
        (m, _) => Err(protocol(app.name(), format!("{m:?} where the setup message was due"))),
    }
}

/// The consumer's return of frame `seq` (returns come in order).
fn expect_return(ret: &Channel, seq: u64) -> Result<()> {
    match messages::recv(ret)?.0 {
        Message::Return { seq: got } if got == seq => Ok(()),
        m => Err(protocol(ret.name(), format!("{m:?} where the return of frame {seq} was due"))),
    }
}

fn producer_shared(o: &Options, out: Channel, ret: Channel) -> Result<StageStats> {
    let source = o.source.open()?;
    let mut st = StageStats { source_name: source.name(), ..Default::default() };
    let frames = frame_allocator(o, source)?;
    let to_transform = exporter_to(&out, "producer->transform (ipc)")?;
    let to_consumer = exporter_to(&ret, "producer->consumer (ipc)")?;
    let start = Instant::now();
    let mut returned = 0;
    for seq in 0..o.frames {
        crash_point(o, Stage::Producer, seq);
        while seq - returned >= o.pool_size as u64 {
            expect_return(&ret, returned)?;
            returned += 1;
        }
        let block = frames.allocate(o.frame_size, None)?;
        produce_in_place(block.cpu_access(Access::Write)?, seq, o.frame_size)?;
        let handles = vec![to_transform.export(&block, None)?, to_consumer.export(&block, None)?];
        // Freed at once: the allocator keeps it (limbo) until both stages released it.
        drop(block);
        if malformed_now(o, Stage::Producer, seq) {
            out.send_bytes(&GARBAGE, &[])?;
        } else {
            messages::send(&out, &Message::Frame { seq, handles })?;
        }
        st.frames += 1;
    }
    while returned < o.frames {
        expect_return(&ret, returned)?;
        returned += 1;
    }
    st.elapsed_ns = start.elapsed().as_nanos() as u64;
    messages::send(&out, &Message::End { count: o.frames })?;
    st.buffers = frames.stats().num_device_alloc as u64;
    // The two setup fds, and each segment's fd once per stage.
    st.fds_passed =
        out.fds_sent() + ret.fds_sent() + to_transform.channel().fds_sent() + to_consumer.channel().fds_sent();
    st.control_bytes =
        ret.bytes_sent() + out.bytes_sent() + to_transform.channel().bytes_sent() + to_consumer.channel().bytes_sent();
    Ok(st)
}

/// Frame `seq` (with `handles` handles) or the end, as the pipeline expects next on `channel`.
fn due_frame(o: &Options, seq: u64, m: Message, handles: usize, channel: &str) -> Result<Option<IpcHandle>> {
    match m {
        Message::End { count } if count == seq && seq == o.frames => Ok(None),
        Message::End { count } => {
            Err(protocol(channel, format!("end of stream after {count} frames, but {seq} of {} arrived", o.frames)))
        }
        Message::Frame { seq: got, .. } if got != seq || seq >= o.frames => {
            Err(protocol(channel, format!("frame {got} where frame {seq} of {} was due", o.frames)))
        }
        Message::Frame { handles: h, .. } if h.len() != handles => {
            Err(protocol(channel, format!("a frame with {} handles, expected {handles}", h.len())))
        }
        Message::Frame { handles: h, .. } if h[0].len != o.frame_size as u64 => {
            Err(protocol(channel, format!("frame of {} bytes, expected {}", h[0].len, o.frame_size)))
        }
        Message::Frame { handles: h, .. } => Ok(Some(*h.last().expect("checked"))),
        m => Err(protocol(channel, format!("{m:?} where frame {seq} was due"))),
    }
}

fn producer_pipes(o: &Options, mut out: PipeOut, ret: Channel) -> Result<StageStats> {
    let mut st = StageStats { source_name: "private buffers".into(), ..Default::default() };
    let mut private = vec![0u8; o.frame_size];
    // No buffers cross, but the same ids bound the frames in flight.
    let mut ledger = Ledger::new(o.pool_size)?;
    let start = Instant::now();
    for seq in 0..o.frames {
        crash_point(o, Stage::Producer, seq);
        let id = loop {
            match ledger.take() {
                Some(id) => break id,
                None => drop(ledger.recv_return(&ret)?),
            }
        };
        produce_bytes(seq, 0, &mut private);
        if malformed_now(o, Stage::Producer, seq) {
            out.header(&GARBAGE)?;
            ledger.put_back(id)?;
        } else {
            out.header(&PoolMessage::Frame(Frame { id, seq, len: o.frame_size as u64 }).to_bytes())?;
            ledger.lend(id, seq)?;
        }
        out.frame(&private)?;
        st.frames += 1;
    }
    while ledger.out_count() > 0 {
        ledger.recv_return(&ret)?;
    }
    st.elapsed_ns = start.elapsed().as_nanos() as u64;
    out.header(&PoolMessage::End { count: o.frames }.to_bytes())?;
    st.control_bytes = ret.bytes_sent() + out.headers;
    st.bytes_copied = out.frame_bytes;
    Ok(st)
}

fn transform_shared(o: &Options, input: Channel, out: Channel) -> Result<StageStats> {
    let mut st = StageStats { source_name: o.source.to_string(), ..Default::default() };
    let from_producer = importer_from(&input, "producer->transform (ipc)")?;
    let mut seq = 0;
    loop {
        let m = messages::recv(&input)?.0;
        // The transform's own handle comes first; the consumer's is passed on as it is.
        let mine = match &m {
            Message::Frame { handles, .. } if handles.len() == 2 => Some(handles[0]),
            _ => None,
        };
        let Some(theirs) = due_frame(o, seq, m, 2, input.name())? else { break };
        crash_point(o, Stage::Transform, seq);
        let block = from_producer.open(&mine.expect("a frame of two handles"))?;
        if o.fault != Some(Fault::SkipTransform { seq }) {
            transform_in_place(block.cpu_access(Access::ReadWrite)?, seq, o.frame_size)?;
        }
        // Released to the producer; the consumer's handle still holds the block.
        drop(block);
        if malformed_now(o, Stage::Transform, seq) {
            out.send_bytes(&GARBAGE, &[])?;
        } else {
            messages::send(&out, &Message::Frame { seq, handles: vec![theirs] })?;
        }
        st.frames += 1;
        seq += 1;
    }
    messages::send(&out, &Message::End { count: seq })?;
    st.control_bytes = out.bytes_sent() + from_producer.channel().bytes_sent();
    Ok(st)
}

fn transform_pipes(o: &Options, mut input: PipeIn, mut out: PipeOut) -> Result<StageStats> {
    let mut st = StageStats { source_name: o.source.to_string(), ..Default::default() };
    let mut buf = vec![0u8; o.frame_size];
    let mut seq = 0;
    while let Some(frame) = next_piped(o, &mut input, &mut buf, seq)? {
        crash_point(o, Stage::Transform, seq);
        if o.fault != Some(Fault::SkipTransform { seq }) {
            transform_bytes(seq, &mut buf);
        }
        let bad = malformed_now(o, Stage::Transform, seq);
        out.header(&if bad { GARBAGE } else { PoolMessage::Frame(frame).to_bytes() })?;
        out.frame(&buf)?;
        st.frames += 1;
        seq += 1;
    }
    out.header(&PoolMessage::End { count: seq }.to_bytes())?;
    st.control_bytes = out.headers;
    st.bytes_copied = out.frame_bytes;
    Ok(st)
}

fn consumer_shared(o: &Options, input: Channel, ret: Channel) -> Result<StageStats> {
    let mut st = StageStats { source_name: o.source.to_string(), ..Default::default() };
    let from_producer = importer_from(&ret, "producer->consumer (ipc)")?;
    let mut seq = 0;
    while let Some(handle) = due_frame(o, seq, messages::recv(&input)?.0, 1, input.name())? {
        crash_point(o, Stage::Consumer, seq);
        let block = from_producer.open(&handle)?;
        verify_in_place(block.cpu_access(Access::Read)?, seq, o.frame_size)?;
        drop(block);
        st.verified += 1;
        if malformed_now(o, Stage::Consumer, seq) {
            ret.send_bytes(&GARBAGE, &[])?;
        } else {
            messages::send(&ret, &Message::Return { seq })?;
        }
        st.frames += 1;
        seq += 1;
    }
    st.control_bytes = ret.bytes_sent() + from_producer.channel().bytes_sent();
    Ok(st)
}

fn consumer_pipes(o: &Options, mut input: PipeIn, ret: Channel) -> Result<StageStats> {
    let mut st = StageStats { source_name: o.source.to_string(), ..Default::default() };
    let mut buf = vec![0u8; o.frame_size];
    let mut seq = 0;
    while let Some(frame) = next_piped(o, &mut input, &mut buf, seq)? {
        crash_point(o, Stage::Consumer, seq);
        verify_bytes(seq, 0, &buf)?;
        st.verified += 1;
        if malformed_now(o, Stage::Consumer, seq) {
            ret.send_bytes(&GARBAGE, &[])?;
        } else {
            ret.send(&PoolMessage::Return { id: frame.id, seq })?;
        }
        st.frames += 1;
        seq += 1;
    }
    st.control_bytes = ret.bytes_sent();
    Ok(st)
}
