//! Batches: seeded synthetic sources with a known loss floor, and token files.
//!
//! * [`MarkovChain`]: first-order Markov tokens. Each state has `branching`
//!   successors with random probabilities; the sequence starts from the
//!   stationary distribution, so the process is stationary and the best
//!   possible next-token loss is exactly the chain's entropy rate
//!   `H = sum_s pi(s) H(P(s, .))` (nats).
//! * [`TokenFile`]: llm.c `.bin` files (256 x i32 header, magic 20240520,
//!   then u16 tokens) or nanoGPT's headerless u16 files, memory-mapped.
//! * Regression: Gaussian inputs, target `w . mean_t(x) * sqrt(T) + noise * e`;
//!   the MSE floor is `noise^2`.
//! * Images ([`images`]): class prototypes plus noise with label
//!   noise; the floor is the label noise's entropy. Augmented on the data
//!   threads.
//! * Pairs ([`Translation`]): source and target sequences of `seq_len`
//!   tokens each for the `t5` model; the floor is the entropy of the
//!   target's noise.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;
use tch::{Device, Kind, Tensor};

pub mod images;
mod markov;
pub mod pairs;
mod sample;
mod tokens;

use harness_format::suite::floor::DEFAULT_DATA_SEED;
use harness_format::suite::{DataSpec, Pipeline, DEFAULT_BIN_VOCAB};
use images::{DeviceImages, ImageSample, ImageSource, ImageSpec};
pub use markov::MarkovChain;
pub use pairs::Translation;
use sample::{sample_rng, upload};
use tokens::check_split;
pub use tokens::{DataError, TokenFile, LLMC_MAGIC};

/// One batch on the training device.
pub struct Batch {
    pub input: Tensor,
    pub target: Tensor,
    /// Tokens (or positions) in the batch.
    pub tokens: usize,
    pub samples: usize,
}

impl Batch {
    /// The batch on `device` (the same tensors when it is there already).
    pub fn to_device(&self, device: Device) -> Batch {
        let on = |t: &Tensor| match (t.device(), device) {
            (from, to) if from == to => t.shallow_clone(),
            (_, Device::Cpu) => t.to_device(Device::Cpu),
            _ => upload(t.shallow_clone(), device),
        };
        Batch { input: on(&self.input), target: on(&self.target), tokens: self.tokens, samples: self.samples }
    }
}

/// Where samples come from; shared with the prefetch thread.
enum SampleSource {
    Markov(MarkovChain),
    File { file: TokenFile, range: (usize, usize) },
    Gaussian { dim: usize },
    Images(ImageSource),
    Pairs(Translation),
}

/// One training sample, made on the host.
enum Sample {
    /// `seq_len + 1` tokens, or for pairs the source (`seq_len` words and
    /// the end token) then the target (`seq_len` words).
    Tokens(Vec<i64>),
    /// `seq_len x dim` inputs and one unit-normal noise draw for the target.
    Gaussian(Vec<f32>, f32),
    /// One image and its label.
    Image(ImageSample),
}

impl SampleSource {
    fn sample(&self, rng: &mut ChaCha8Rng, t: usize) -> Sample {
        match self {
            SampleSource::Markov(chain) => {
                let mut buf = Vec::with_capacity(t + 1);
                chain.sample_into(rng, t + 1, &mut buf);
                Sample::Tokens(buf)
            }
            SampleSource::File { file, range } => {
                let start = rng.random_range(range.0..=range.1 - (t + 1));
                Sample::Tokens((start..start + t + 1).map(|i| file.get(i) as i64).collect())
            }
            SampleSource::Gaussian { dim } => {
                // Ziggurat: several times faster than Box-Muller, which made
                // the encoder's inputs the bottleneck of a GPU step.
                let x = (0..t * dim).map(|_| rng.sample::<f32, _>(StandardNormal)).collect();
                Sample::Gaussian(x, rng.sample::<f32, _>(StandardNormal))
            }
            SampleSource::Images(src) => Sample::Image(src.sample(rng)),
            SampleSource::Pairs(task) => {
                let (mut src, mut tgt) = (Vec::with_capacity(2 * t + 1), Vec::with_capacity(t));
                task.sample_into(rng, t, &mut src, &mut tgt);
                src.extend(tgt);
                Sample::Tokens(src)
            }
        }
    }
}

/// Samples are made ahead on background threads (as DataLoader workers
/// would), so the training thread only collates and uploads them. Sample `i`
/// of the stream is drawn from its own generator (the seed's ChaCha8 stream
/// number `i`), so the stream is fixed by the seed alone, whatever the batch
/// sizes and however many workers make it; worker `w` makes the samples
/// `i = w mod workers`, and they are handed out in order.
struct Prefetch {
    rxs: Vec<std::sync::mpsc::Receiver<Sample>>,
    /// Index of the next sample to hand out.
    next: u64,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl Prefetch {
    /// Starts the stream at sample `skip` (no sample before it is made),
    /// with `workers` threads holding up to `depth` samples in all.
    fn start(source: Arc<SampleSource>, seed: u64, t: usize, depth: usize, skip: u64, workers: usize) -> Prefetch {
        let k = workers.max(1);
        let mut rxs = Vec::with_capacity(k);
        let mut handles = Vec::with_capacity(k);
        for w in 0..k as u64 {
            let (tx, rx) = std::sync::mpsc::sync_channel((depth / k).max(4));
            let source = source.clone();
            // The first index at or after `skip` that this worker makes.
            let first = skip + (w + k as u64 - skip % k as u64) % k as u64;
            let worker = std::thread::Builder::new()
                .name(format!("harness-data-{w}"))
                .spawn(move || {
                    let mut i = first;
                    // Ends when the receiver is dropped.
                    while tx.send(source.sample(&mut sample_rng(seed, i), t)).is_ok() {
                        i += k as u64;
                    }
                })
                .expect("spawning a data thread");
            rxs.push(rx);
            handles.push(worker);
        }
        Prefetch { rxs, next: skip, workers: handles }
    }

    fn next(&mut self) -> Sample {
        let k = self.rxs.len() as u64;
        let s = self.rxs[(self.next % k) as usize].recv().expect("a data thread ended early");
        self.next += 1;
        s
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        self.rxs.clear();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Image batches collated ahead of the training thread, on a thread of
/// their own: the samples of the next batch are gathered from the
/// [`Prefetch`] workers into one `[n, C, H, W]` tensor (in pinned memory
/// when training on CUDA, so the upload can run without blocking) while
/// the device trains on the current one. The next batch is taken to be as
/// large as the last; when the batch policy asks for another size, rows
/// are split off or more are fetched, in stream order, so the batches hold
/// the same samples whatever was guessed.
struct Collator {
    requests: std::sync::mpsc::Sender<usize>,
    batches: std::sync::mpsc::Receiver<(Tensor, Tensor)>,
    /// Sizes of the batches asked for and not yet received.
    in_flight: std::collections::VecDeque<usize>,
    /// Rows received and not yet handed out (pixels, labels).
    leftover: Option<(Tensor, Tensor)>,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl Collator {
    /// Collates the samples of `stream`, images of `shape` (C, H, W), in
    /// pinned memory for the GPU `cuda`.
    fn start(mut stream: Prefetch, shape: [i64; 3], cuda: Option<usize>) -> Collator {
        let (requests, rx) = std::sync::mpsc::channel::<usize>();
        let (tx, batches) = std::sync::mpsc::sync_channel(2);
        let worker = std::thread::Builder::new()
            .name("harness-collate".into())
            .spawn(move || {
                // Pinned memory belongs to the current GPU's context: this
                // thread's must be the training GPU's, or each rank process
                // would also open a context on GPU 0 (PyTorch's pin-memory
                // thread sets its device for the same reason). Without it,
                // batches go unpinned and uploads copy synchronously.
                let pinned = cuda.is_some_and(|i| harness_runtime::device::make_current(i).is_ok());
                // Ends when the requests' sender or the batches' receiver goes.
                while let Ok(n) = rx.recv() {
                    let mut px = Vec::with_capacity(n * (shape[0] * shape[1] * shape[2]) as usize);
                    let mut labels = Vec::with_capacity(n);
                    for _ in 0..n {
                        if let Sample::Image(img) = stream.next() {
                            px.extend(img.pixels);
                            labels.push(img.label);
                        }
                    }
                    let x = Tensor::from_slice(&px).view([n as i64, shape[0], shape[1], shape[2]]);
                    let y = Tensor::from_slice(&labels);
                    // Pinned memory can run out; the upload then copies
                    // synchronously.
                    let pin = |t: Tensor| if pinned { harness_kernels::torch_ext::pin_memory(&t).unwrap_or(t) } else { t };
                    if tx.send((pin(x), pin(y))).is_err() {
                        break;
                    }
                }
            })
            .expect("spawning the collating thread");
        Collator { requests, batches, in_flight: Default::default(), leftover: None, worker: Some(worker) }
    }

    fn ask(&mut self, n: usize) {
        // The worker lives as long as `self`: the send cannot fail.
        let _ = self.requests.send(n);
        self.in_flight.push_back(n);
    }

    /// The next `n` images and labels of the stream, and the next batch
    /// of as many asked for.
    fn next(&mut self, n: usize) -> (Tensor, Tensor) {
        let mut parts: Vec<(Tensor, Tensor)> = self.leftover.take().into_iter().collect();
        let mut have: usize = parts.iter().map(|p| p.1.numel()).sum();
        while have < n {
            if self.in_flight.is_empty() {
                self.ask(n - have);
            }
            let part = self.batches.recv().expect("the collating thread ended early");
            self.in_flight.pop_front();
            have += part.1.numel();
            parts.push(part);
        }
        let (x, y) = if parts.len() == 1 {
            parts.pop().expect("one part")
        } else {
            let (xs, ys): (Vec<Tensor>, Vec<Tensor>) = parts.into_iter().unzip();
            (Tensor::cat(&xs, 0), Tensor::cat(&ys, 0))
        };
        let (x, y) = if have > n {
            let extra = (have - n) as i64;
            self.leftover = Some((x.narrow(0, n as i64, extra), y.narrow(0, n as i64, extra)));
            (x.narrow(0, 0, n as i64), y.narrow(0, 0, n as i64))
        } else {
            (x, y)
        };
        if self.in_flight.is_empty() {
            let ahead = n.saturating_sub(self.leftover.as_ref().map_or(0, |l| l.1.numel()));
            if ahead > 0 {
                self.ask(ahead);
            }
        }
        (x, y)
    }
}

impl Drop for Collator {
    fn drop(&mut self) {
        // Closing both channels ends the worker, which drops its stream.
        let (dead, _) = std::sync::mpsc::channel();
        self.requests = dead;
        let (_, dead) = std::sync::mpsc::sync_channel(1);
        self.batches = dead;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// The training stream: samples, or image batches collated ahead.
enum Stream {
    Samples(Prefetch),
    Images(Collator),
    /// Images made on the training device.
    Device(DeviceImages),
    /// Regression inputs drawn on the training device.
    Gaussian(DeviceGaussian),
}

/// Samples made ahead of the training thread.
const PREFETCH_DEPTH: usize = 256;

/// Data threads per stream: a quarter of the cores, 1 to 4 (a host with
/// several ranks runs a stream per rank).
fn data_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get() / 4).clamp(1, 4)
}

/// The data stream of one entry: training batches and a fixed eval set.
pub struct Data {
    train: Stream,
    /// What `train` draws from, and its seed (to restart it elsewhere).
    source: Arc<SampleSource>,
    seed: u64,
    eval: Arc<SampleSource>,
    eval_seed: u64,
    floor: Option<f64>,
    /// Classification: the best reachable top-1 accuracy.
    best_accuracy: Option<f64>,
    /// Regression: the fixed unit vector and the noise level.
    regression: Option<(Tensor, f64)>,
    /// Images: (channels, side).
    image: Option<(i64, i64)>,
    /// Threads making training samples.
    workers: usize,
    /// Images or regression inputs: made on the device rather than on
    /// host threads.
    on_device: bool,
    /// Images: the type training batches come in ([`Data::images_in`]).
    image_kind: Option<Kind>,
    seq_len: usize,
    consumed: u64,
    device: Device,
}

impl Data {
    /// Builds the stream for a workload. `dim` is the encoder's input width.
    pub fn new(spec: &DataSpec, suite_dir: &Path, seq_len: usize, dim: usize, seed: u64, device: Device) -> anyhow::Result<Data> {
        let t = seq_len;
        let (train, eval, floor, regression) = match spec {
            DataSpec::Synthetic { vocab, branching, seed: s } => {
                // The chain is the task: fixed by the suite's data seed (or a
                // default), not by the repeat, so every repeat learns the same
                // distribution from different samples and initialisations.
                let chain = MarkovChain::new(*vocab as usize, *branching as usize, s.unwrap_or(DEFAULT_DATA_SEED));
                let floor = chain.entropy_rate();
                let src = Arc::new(SampleSource::Markov(chain));
                (src.clone(), src, Some(floor), None)
            }
            DataSpec::Bin { train, val, val_fraction, .. } => {
                let resolve = |p: &PathBuf| if p.is_absolute() { p.clone() } else { suite_dir.join(p) };
                let vocab = spec.vocab().unwrap_or(DEFAULT_BIN_VOCAB);
                let train_file = TokenFile::open(&resolve(train))?;
                let (train_src, eval_src) = match val {
                    Some(v) => {
                        let v = TokenFile::open(&resolve(v))?;
                        let (n, m) = (train_file.len(), v.len());
                        (SampleSource::File { file: train_file, range: (0, n) }, SampleSource::File { file: v, range: (0, m) })
                    }
                    None => {
                        let n = train_file.len();
                        let cut = ((n as f64) * (1.0 - val_fraction)) as usize;
                        let again = TokenFile::open(train_file.path())?;
                        (SampleSource::File { file: train_file, range: (0, cut) }, SampleSource::File { file: again, range: (cut, n) })
                    }
                };
                for src in [&train_src, &eval_src] {
                    if let SampleSource::File { file, range } = src {
                        check_split(file, *range, t, vocab)?;
                    }
                }
                (Arc::new(train_src), Arc::new(eval_src), None, None)
            }
            DataSpec::Regression { noise, seed: s, .. } => {
                let mut rng = ChaCha8Rng::seed_from_u64(s.unwrap_or(DEFAULT_DATA_SEED));
                let w: Vec<f32> = (0..dim).map(|_| normal(&mut rng) as f32).collect();
                let w = Tensor::from_slice(&w);
                let w = (&w / w.norm()).to_device(device);
                let src = Arc::new(SampleSource::Gaussian { dim });
                (src.clone(), src, spec.loss_floor(), Some((w, *noise)))
            }
            DataSpec::Images { classes, image_size, channels, noise, label_noise, augment, padding, seed: s, .. } => {
                let spec = ImageSpec {
                    classes: *classes as usize,
                    size: *image_size as usize,
                    channels: *channels as usize,
                    noise: *noise,
                    label_noise: *label_noise,
                    padding: *padding as usize,
                    seed: s.unwrap_or(DEFAULT_DATA_SEED),
                };
                // Training samples are augmented, eval samples only normalised.
                let train = ImageSource::new(spec, *augment)?;
                let eval = train.with_augment(false);
                let floor = train.loss_floor();
                (Arc::new(SampleSource::Images(train)), Arc::new(SampleSource::Images(eval)), Some(floor), None)
            }
            DataSpec::Pairs { vocab, noise, seed: s } => {
                // The dictionary is the task, fixed by the data seed as the
                // Markov chain is.
                let task = Translation::new(*vocab as usize, *noise, s.unwrap_or(DEFAULT_DATA_SEED));
                let floor = task.floor();
                let src = Arc::new(SampleSource::Pairs(task));
                (src.clone(), src, Some(floor), None)
            }
        };
        let (image, best_accuracy, workers, on_device) = match (spec, &*train) {
            (DataSpec::Images { threads, pipeline, .. }, SampleSource::Images(src)) => (
                Some((src.spec().channels as i64, src.spec().size as i64)),
                Some(src.best_accuracy()),
                threads.map_or_else(data_workers, |n| n as usize),
                // Throughput runs on a GPU make their images there unless
                // asked for host threads.
                pipeline.unwrap_or(if device.is_cuda() && threads.is_none() { Pipeline::Device } else { Pipeline::Host })
                    == Pipeline::Device,
            ),
            // Regression inputs on a GPU are drawn there unless asked for
            // host threads: at the claims5 encoder's 32 x 128 tokens, host
            // threads took 14 of a 24 ms step on an H100.
            (DataSpec::Regression { pipeline, .. }, _) => (
                None,
                None,
                data_workers(),
                pipeline.unwrap_or(if device.is_cuda() { Pipeline::Device } else { Pipeline::Host }) == Pipeline::Device,
            ),
            _ => (None, None, data_workers(), false),
        };
        Ok(Data {
            train: stream(&train, seed, t, 0, workers, on_device, image, device),
            source: train,
            seed,
            eval,
            eval_seed: seed ^ 0xe7a1_5eed,
            floor,
            best_accuracy,
            regression,
            image,
            workers,
            on_device,
            image_kind: None,
            seq_len: t,
            consumed: 0,
            device,
        })
    }

    /// The best reachable loss, when the source knows it.
    pub fn loss_floor(&self) -> Option<f64> {
        self.floor
    }

    /// The best reachable top-1 accuracy of a classification source.
    pub fn best_accuracy(&self) -> Option<f64> {
        self.best_accuracy
    }

    /// Training samples taken so far (the stream's position).
    pub fn position(&self) -> u64 {
        self.consumed
    }

    /// Moves the training stream to `position` (samples handed out), as
    /// after [`Data::position`] returned it: the following batches are the
    /// ones that came next then.
    pub fn seek(&mut self, position: u64) {
        self.train = stream(&self.source, self.seed, self.seq_len, position, self.workers, self.on_device, self.image, self.device);
        self.consumed = position;
    }

    /// Training images come in `kind` from now on, cast as they are made:
    /// for a model whose first layer casts them to that type anyway (bf16
    /// autocast), the same values, without the fp32 batch (154 MB for
    /// ResNet-50 at 256 x 224 x 224) at the step's peak, where a CUDA graph
    /// keeps its input. Eval batches are not cast (autocast casts them).
    pub fn images_in(&mut self, kind: Kind) {
        self.image_kind = Some(kind);
    }

    /// A training image batch in [`Data::images_in`]'s type (its layout kept).
    fn image_cast(&self, x: Tensor) -> Tensor {
        match self.image_kind {
            Some(k) if x.kind() != k => x.to_kind(k),
            _ => x,
        }
    }

    /// The next training batch of `batch` samples.
    pub fn next_train(&mut self, batch: usize) -> Batch {
        self.consumed += batch as u64;
        match &mut self.train {
            Stream::Samples(p) => {
                let samples: Vec<Sample> = (0..batch).map(|_| p.next()).collect();
                self.to_batch(samples, self.device)
            }
            Stream::Images(c) => {
                let (x, y) = c.next(batch);
                // One image is one "token" (seq_len is 1).
                let tokens = batch * self.seq_len;
                Batch { input: self.image_cast(upload(x, self.device)), target: upload(y, self.device), tokens, samples: batch }
            }
            Stream::Device(d) => {
                let (input, target) = d.next(batch).expect("making images on the device");
                Batch { input: self.image_cast(input), target, tokens: batch * self.seq_len, samples: batch }
            }
            Stream::Gaussian(g) => {
                let (x, e) = g.next(batch).expect("drawing regression inputs on the device");
                let (w, noise) = self.regression.as_ref().expect("a regression stream has its task");
                Batch { target: regression_target(&x, &e, w, *noise), input: x, tokens: batch * self.seq_len, samples: batch }
            }
        }
    }

    /// The fixed eval set: `n` batches, the same at every evaluation, kept
    /// in host memory ([`Batch::to_device`] uploads one at a time) so that
    /// it takes no device memory from training (ImageNet-shaped images are
    /// 0.6 MB each).
    pub fn eval_set(&mut self, n: usize, batch: usize) -> Vec<Batch> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.eval_seed);
        (0..n)
            .map(|_| {
                let samples = (0..batch).map(|_| self.eval.sample(&mut rng, self.seq_len)).collect();
                self.to_batch(samples, Device::Cpu)
            })
            .collect()
    }

    /// `samples` as one batch on `device` (a regression batch's targets are
    /// computed on the training device, where the task's vector lives).
    fn to_batch(&self, samples: Vec<Sample>, device: Device) -> Batch {
        let (b, t) = (samples.len(), self.seq_len);
        if let Some((c, side)) = self.image {
            let mut px = Vec::with_capacity(b * (c * side * side) as usize);
            let mut labels = Vec::with_capacity(b);
            for s in samples {
                if let Sample::Image(img) = s {
                    px.extend(img.pixels);
                    labels.push(img.label);
                }
            }
            let input = upload(Tensor::from_slice(&px).view([b as i64, c, side, side]), device);
            let target = upload(Tensor::from_slice(&labels), device);
            // One image is one "token" (seq_len is 1).
            return Batch { input, target, tokens: b * t, samples: b };
        }
        match &self.regression {
            // Samples are (source, target) pairs.
            None if matches!(*self.source, SampleSource::Pairs(_)) => {
                // Sources then targets: the targets are the predicted tokens.
                let mut buf = Vec::with_capacity(b * (2 * t + 1));
                for s in samples {
                    if let Sample::Tokens(v) = s {
                        buf.extend(v);
                    }
                }
                let all = upload(Tensor::from_slice(&buf).view([b as i64, 2 * t as i64 + 1]), device);
                Batch { input: all.narrow(1, 0, t as i64 + 1), target: all.narrow(1, t as i64 + 1, t as i64), tokens: b * t, samples: b }
            }
            None => {
                let mut buf = Vec::with_capacity(b * (t + 1));
                for s in samples {
                    if let Sample::Tokens(v) = s {
                        buf.extend(v);
                    }
                }
                let all = upload(Tensor::from_slice(&buf).view([b as i64, t as i64 + 1]), device);
                Batch { input: all.narrow(1, 0, t as i64), target: all.narrow(1, 1, t as i64), tokens: b * t, samples: b }
            }
            Some((w, noise)) => {
                let dim = w.size()[0];
                let mut xs = Vec::with_capacity(b * t * dim as usize);
                let mut es = Vec::with_capacity(b);
                for s in samples {
                    if let Sample::Gaussian(x, e) = s {
                        xs.extend(x);
                        es.push(e);
                    }
                }
                let x = upload(Tensor::from_slice(&xs).view([b as i64, t as i64, dim]), self.device);
                let e = upload(Tensor::from_slice(&es), self.device);
                let y = regression_target(&x, &e, w, *noise);
                Batch { input: x, target: y, tokens: b * t, samples: b }.to_device(device)
            }
        }
    }
}

/// The regression target of inputs `x` (`[b, t, dim]`) and unit noise
/// draws `e` (`[b]`) for the task's unit vector `w`: `w . mean_t(x) *
/// sqrt(t) + noise * e`.
fn regression_target(x: &Tensor, e: &Tensor, w: &Tensor, noise: f64) -> Tensor {
    let t = x.size()[1];
    x.mean_dim(1, false, Kind::Float).matmul(w) * (t as f64).sqrt() + e * noise
}

/// Regression inputs drawn on the training device (`pipeline = "device"`):
/// the same law as [`SampleSource::Gaussian`]'s samples, a batch's inputs
/// and target noise drawn at once from a generator seeded by the stream's
/// seed and the batch's first sample, so a stream is fixed by its seed and
/// its batch sizes.
struct DeviceGaussian {
    seed: u64,
    /// Index of the next sample.
    next: u64,
    t: i64,
    dim: i64,
    device: Device,
}

impl DeviceGaussian {
    /// The next `n` samples' inputs (`[n, t, dim]`) and target noise
    /// draws (`[n]`).
    fn next(&mut self, n: usize) -> Result<(Tensor, Tensor), harness_kernels::torch_ext::TorchError> {
        let (start, b) = (self.next, n as i64);
        self.next += n as u64;
        let seed = harness_format::suite::mix_seed(self.seed, "device regression", 0) ^ start.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let all = harness_kernels::torch_ext::rand_seeded(
            harness_kernels::torch_ext::RandKind::Normal,
            &[b * (self.t * self.dim + 1)],
            seed,
            self.device,
        )?;
        let x = all.narrow(0, 0, b * self.t * self.dim).view([b, self.t, self.dim]);
        Ok((x, all.narrow(0, b * self.t * self.dim, b)))
    }
}

/// The training stream of `source` seeded `seed` from sample `skip` on:
/// with `on_device`, images or regression inputs made on the device; else
/// images of `image` (channels, side) made on `workers` host threads and
/// collated ahead, and other samples made ahead on `workers` threads.
#[allow(clippy::too_many_arguments)]
fn stream(
    source: &Arc<SampleSource>,
    seed: u64,
    t: usize,
    skip: u64,
    workers: usize,
    on_device: bool,
    image: Option<(i64, i64)>,
    device: Device,
) -> Stream {
    match (&**source, on_device) {
        (SampleSource::Images(src), true) => return Stream::Device(DeviceImages::new(src, seed, skip, device)),
        (SampleSource::Gaussian { dim }, true) => {
            return Stream::Gaussian(DeviceGaussian { seed, next: skip, t: t as i64, dim: *dim as i64, device });
        }
        _ => {}
    }
    // Deep enough for a few batches of the largest sizes in our suites.
    let samples = Prefetch::start(source.clone(), seed, t, PREFETCH_DEPTH, skip, workers);
    match image {
        Some((c, side)) => {
            let cuda = match device {
                Device::Cuda(i) => Some(i),
                _ => None,
            };
            Stream::Images(Collator::start(samples, [c, side, side], cuda))
        }
        None => Stream::Samples(samples),
    }
}

/// A standard normal sample (Box-Muller).
fn normal(rng: &mut impl Rng) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

#[cfg(test)]
mod tests;
