//! Class-conditional images whose best reachable loss and accuracy are known,
//! and the CPU input pipeline of image training (augmentation and
//! normalisation, run on the data threads of [`super`]).
//!
//! Each of `K` classes has a seeded prototype: a `4 x 4` grid per channel of
//! standard normal values, enlarged to the image by nearest-neighbour
//! blocks, scaled by [`AMPLITUDE`] around [`MEAN`]. A sample draws a class
//! uniformly, adds Gaussian pixel noise of standard deviation `noise`, and
//! keeps the class as its label with probability `1 - p`, else takes a
//! uniformly random other class (`p` = `label_noise`).
//!
//! When the noisy images still tell their class apart (checked when the
//! source is made, see [`ImageSource::new`]), the posterior of the label
//! given the image is `1 - p` on the true class and `p / (K - 1)` on each
//! other, so the lowest expected cross-entropy is the entropy of the label
//! noise, `H = -(1 - p) ln(1 - p) - p ln(p / (K - 1))`, and the best top-1
//! accuracy is `1 - p`.
//!
//! Training samples are augmented as CIFAR and ImageNet pipelines do: a
//! random crop of the image padded with `padding` zeros on each side, and a
//! horizontal flip with probability 1/2; every sample, training or eval, is
//! then normalised per channel. A sample's randomness (class, label, noise,
//! crop, flip) comes from that sample's own generator, so the stream does
//! not depend on how many threads make it. `data.rs` collates batches of
//! them ahead of the training thread (pinned on CUDA).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

/// Prototype grid cells per side.
pub const GRID: usize = 4;
/// Pixel mean of every channel before normalisation.
pub const MEAN: f64 = 0.5;
/// Scale of the prototypes around [`MEAN`].
pub const AMPLITUDE: f64 = 0.25;
/// The least separation between two classes' prototypes, in pixel-noise
/// standard deviations from each to the midpoint, for the floor to hold:
/// a noisy image is then nearer another class's prototype with
/// probability below `(K - 1) x Phi(-6)`, about `1e-9 x K`.
pub const MIN_SEPARATION: f64 = 6.0;

/// The shape and randomness of an image source (the `images` data table).
#[derive(Debug, Clone, PartialEq)]
pub struct ImageSpec {
    pub classes: usize,
    pub size: usize,
    pub channels: usize,
    pub noise: f64,
    pub label_noise: f64,
    pub padding: usize,
    pub seed: u64,
}

/// Errors making an image source.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(
        "image classes are not separable enough for the loss floor to hold: two prototypes lie {separation:.2} noise \
         standard deviations from their midpoint (at least {MIN_SEPARATION} needed); lower `noise`, raise `image_size` or \
         change the data `seed`"
    )]
    NotSeparable { separation: f64 },
}

/// Prototypes and label noise of the `images` data.
#[derive(Debug)]
pub struct ImageSource {
    spec: ImageSpec,
    /// `K x C x GRID x GRID` prototype values (standard normal).
    grid: Vec<f32>,
    /// Per channel: (mean, standard deviation) of the pixels.
    norm: (f32, f32),
    /// Training samples are cropped and flipped.
    augment: bool,
}

/// One image sample: `C x H x W` normalised pixels and its label.
pub struct ImageSample {
    pub pixels: Vec<f32>,
    pub label: i64,
}

impl ImageSource {
    /// The source of `spec`; fails when the classes are too close for the
    /// loss floor to hold.
    pub fn new(spec: ImageSpec, augment: bool) -> Result<ImageSource, ImageError> {
        let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
        let n = spec.classes * spec.channels * GRID * GRID;
        let grid: Vec<f32> = (0..n).map(|_| rng.sample::<f32, _>(StandardNormal)).collect();
        // Pixels are MEAN + AMPLITUDE x z + noise x e with z, e standard
        // normal: their variance is AMPLITUDE^2 + noise^2.
        let std = (AMPLITUDE * AMPLITUDE + spec.noise * spec.noise).sqrt();
        let src = ImageSource { spec, grid, norm: (MEAN as f32, std as f32), augment };
        let separation = src.separation();
        if separation < MIN_SEPARATION {
            return Err(ImageError::NotSeparable { separation });
        }
        Ok(src)
    }

    /// The spec it was made from.
    pub fn spec(&self) -> &ImageSpec {
        &self.spec
    }

    /// The same prototypes, augmented or not.
    pub fn with_augment(&self, augment: bool) -> ImageSource {
        ImageSource { spec: self.spec.clone(), grid: self.grid.clone(), norm: self.norm, augment }
    }

    /// A lower bound of the distance between the two nearest prototypes,
    /// over twice the pixel noise (infinite without noise). Every grid cell
    /// covers at least `floor(size / GRID)^2` pixels, so the images'
    /// distance is at least that side times the grids' distance.
    pub fn separation(&self) -> f64 {
        let (k, d) = (self.spec.classes, self.spec.channels * GRID * GRID);
        let mut least = f64::INFINITY;
        for a in 0..k {
            for b in a + 1..k {
                let sq: f64 = (0..d).map(|i| (self.grid[a * d + i] - self.grid[b * d + i]) as f64).map(|x| x * x).sum();
                least = least.min(sq.sqrt());
            }
        }
        let side = (self.spec.size / GRID) as f64;
        if self.spec.noise == 0.0 {
            return f64::INFINITY;
        }
        side * AMPLITUDE * least / (2.0 * self.spec.noise)
    }

    /// The lowest expected cross-entropy (nats): the label noise's entropy.
    pub fn loss_floor(&self) -> f64 {
        label_noise_entropy(self.spec.label_noise, self.spec.classes)
    }

    /// The best expected top-1 accuracy: `1 - label_noise`.
    pub fn best_accuracy(&self) -> f64 {
        1.0 - self.spec.label_noise
    }

    /// Values per image.
    pub fn pixels(&self) -> usize {
        self.spec.channels * self.spec.size * self.spec.size
    }

    /// The pixel value (before noise and normalisation) of class `c`'s
    /// prototype in channel `k`, grid cell (`gy`, `gx`).
    fn cell_value(&self, c: usize, k: usize, gy: usize, gx: usize) -> f64 {
        let z = self.grid[((c * self.spec.channels + k) * GRID + gy) * GRID + gx];
        MEAN + AMPLITUDE * z as f64
    }

    /// The clean prototype of class `c` in pixel space (before noise and
    /// normalisation), `C x H x W`.
    pub fn prototype(&self, c: usize) -> Vec<f32> {
        let (ch, s) = (self.spec.channels, self.spec.size);
        let mut out = Vec::with_capacity(self.pixels());
        for k in 0..ch {
            for y in 0..s {
                for x in 0..s {
                    out.push(self.cell_value(c, k, y * GRID / s, x * GRID / s) as f32);
                }
            }
        }
        out
    }

    /// The class and label of a sample, drawn first from its generator.
    fn draw_label(&self, rng: &mut ChaCha8Rng) -> (usize, usize) {
        let k = self.spec.classes;
        let class = rng.random_range(0..k);
        let flip = rng.random::<f64>() < self.spec.label_noise;
        let label = if flip {
            // Uniform over the other K - 1 classes.
            let other = rng.random_range(0..k - 1);
            if other >= class {
                other + 1
            } else {
                other
            }
        } else {
            class
        };
        (class, label)
    }

    /// An image of `class` with its noise, in pixel space.
    fn noisy(&self, class: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
        let sigma = self.spec.noise as f32;
        let mut px = self.prototype(class);
        for v in &mut px {
            *v += sigma * rng.sample::<f32, _>(StandardNormal);
        }
        px
    }

    /// One sample from its own generator: class, label, noise, then (for
    /// training) crop and flip, then normalisation.
    pub fn sample(&self, rng: &mut ChaCha8Rng) -> ImageSample {
        let (class, label) = self.draw_label(rng);
        let px = self.noisy(class, rng);
        let mut px = if self.augment {
            let pad = self.spec.padding;
            let (dy, dx) = (rng.random_range(0..=2 * pad), rng.random_range(0..=2 * pad));
            let flip = rng.random::<bool>();
            crop_flip(&px, self.spec.channels, self.spec.size, pad, dy, dx, flip)
        } else {
            px
        };
        let (m, s) = self.norm;
        for v in &mut px {
            *v = (*v - m) / s;
        }
        ImageSample { pixels: px, label: label as i64 }
    }
}

/// The per-sample draws of the device pipeline: everything but the pixel
/// noise, which [`DeviceImages`] draws for a whole batch on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draw {
    pub class: usize,
    pub label: usize,
    /// Crop offsets into the padded image (`padding` each: no shift).
    pub dy: usize,
    pub dx: usize,
    pub flip: bool,
}

impl ImageSource {
    /// Class, label, crop and flip of one device-pipeline sample, from its
    /// own generator (un-augmented sources keep the image as it is).
    pub fn draw(&self, rng: &mut ChaCha8Rng) -> Draw {
        let (class, label) = self.draw_label(rng);
        let pad = self.spec.padding;
        if !self.augment {
            return Draw { class, label, dy: pad, dx: pad, flip: false };
        }
        let (dy, dx) = (rng.random_range(0..=2 * pad), rng.random_range(0..=2 * pad));
        Draw { class, label, dy, dx, flip: rng.random::<bool>() }
    }
}

/// The `images` data made on the training device (`pipeline = "device"`):
/// the same distribution as [`ImageSource::sample`] with no CPU work but
/// the per-sample draws. Sample `i` takes its class, label, crop and flip
/// from its own generator (as the host pipeline), and a batch's pixel noise
/// is one normal draw on the device from a generator seeded by the stream's
/// seed and the batch's first sample, so a stream is fixed by its seed and
/// its batch sizes. Prototypes are enlarged, noised, cropped, flipped and
/// normalised by tensor ops.
pub struct DeviceImages {
    source: ImageSource,
    seed: u64,
    /// Index of the next sample.
    next: u64,
    device: tch::Device,
    /// `K x C x GRID x GRID` prototypes in pixel space.
    proto: tch::Tensor,
    /// Grid cell of each pixel row (and column).
    cell: tch::Tensor,
}

impl DeviceImages {
    /// The stream seeded `seed` from sample `start` on, on `device`.
    pub fn new(source: &ImageSource, seed: u64, start: u64, device: tch::Device) -> DeviceImages {
        let s = &source.spec;
        // Normalised up front, channels last, `K x (GRID + 1) x (GRID + 1) x
        // C`: the last row and column of cells hold the padding (pixel value
        // 0), which a crop shows outside the image.
        let (k, c, g) = (s.classes, s.channels, GRID);
        let (m, sd) = (f64::from(source.norm.0), f64::from(source.norm.1));
        let mut cells_px = vec![(-m / sd) as f32; k * (g + 1) * (g + 1) * c];
        for class in 0..k {
            for ch in 0..c {
                for y in 0..g {
                    for x in 0..g {
                        cells_px[((class * (g + 1) + y) * (g + 1) + x) * c + ch] = ((source.cell_value(class, ch, y, x) - m) / sd) as f32;
                    }
                }
            }
        }
        let proto = tch::Tensor::from_slice(&cells_px).view([k as i64, g as i64 + 1, g as i64 + 1, c as i64]).to_device(device);
        let cells: Vec<i64> = (0..s.size).map(|y| (y * GRID / s.size) as i64).collect();
        let cell = tch::Tensor::from_slice(&cells).to_device(device);
        DeviceImages { source: source.with_augment(source.augment), seed, next: start, device, proto, cell }
    }

    /// The next `n` images (`n x C x H x W`, f32, normalised; on CUDA with
    /// channels-last strides, as the vision models take them there) and
    /// their labels.
    pub fn next(&mut self, n: usize) -> Result<(tch::Tensor, tch::Tensor), harness_kernels::torch_ext::TorchError> {
        use tch::{Kind, Tensor};
        let start = self.next;
        let draws: Vec<Draw> = (start..start + n as u64).map(|i| self.source.draw(&mut super::sample_rng(self.seed, i))).collect();
        self.next += n as u64;
        let dev = self.device;
        // One pinned, non-blocking upload of the draws (a pageable copy would
        // wait for the device to finish the step before).
        let pad = self.source.spec.padding as i64;
        let mut v: Vec<i64> = Vec::with_capacity(5 * n);
        v.extend(draws.iter().map(|d| d.class as i64));
        v.extend(draws.iter().map(|d| d.label as i64));
        v.extend(draws.iter().map(|d| d.dy as i64 - pad));
        v.extend(draws.iter().map(|d| d.dx as i64 - pad));
        v.extend(draws.iter().map(|d| d.flip as i64));
        let all = super::upload(Tensor::from_slice(&v).view([5, n as i64]), dev);
        let (classes, labels) = (all.get(0), all.get(1));
        let s = &self.source.spec;
        let (b, c, side, g) = (n as i64, s.channels as i64, s.size as i64, GRID as i64);
        // Pixel (y, x) of a sample shows pixel (y + dy - pad, x' + dx -
        // pad) of its image, x' = x or, flipped, side - 1 - x; outside the
        // image it is padding.
        let xs = Tensor::arange(side, (Kind::Int64, dev)).unsqueeze(0);
        let rows = &xs + all.get(2).unsqueeze(1);
        let cols = xs.flip([1]).where_self(&all.get(4).unsqueeze(1).to_kind(Kind::Bool), &xs) + all.get(3).unsqueeze(1);
        // With padding: which shown rows (columns) fall inside the image.
        let inside = |t: &Tensor| t.ge(0).logical_and(&t.lt(side));
        let shown = (self.source.augment && pad > 0).then(|| (inside(&rows), inside(&cols)));
        // The cell each shown pixel row (column) falls in; outside the
        // image, the padding's cell.
        let cell = |t: &Tensor, shown: Option<&Tensor>| {
            let i = self.cell.index_select(0, &t.clamp(0, side - 1).view([-1])).view([b, side]);
            match shown {
                Some(s) => i.masked_fill(&s.logical_not(), g),
                None => i,
            }
        };
        // The prototypes' cells at those pixels (channels last), then the
        // noise: drawn at each pixel shown, which is the same in law as
        // noising the image before cropping; none on the padding. One pass
        // adds it (img + noise x scale, the scale 0 on the padding).
        let img = self.proto.index_select(0, &classes);
        let (rows_in, cols_in) = (shown.as_ref().map(|s| &s.0), shown.as_ref().map(|s| &s.1));
        let img = img.gather(1, &cell(&rows, rows_in).view([b, side, 1, 1]).expand([b, side, g + 1, c], false), false);
        let mut img = img.gather(2, &cell(&cols, cols_in).view([b, 1, side, 1]).expand([b, side, side, c], false), false);
        let noise_seed = harness_format::suite::mix_seed(self.seed, "device images", 0) ^ start.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let noise =
            harness_kernels::torch_ext::rand_seeded(harness_kernels::torch_ext::RandKind::Normal, &[b, side, side, c], noise_seed, dev)?;
        let scale = (s.noise / f64::from(self.source.norm.1)) as f32;
        let scale = match &shown {
            Some((r_in, c_in)) => {
                (r_in.to_kind(Kind::Float) * f64::from(scale)).view([b, side, 1, 1]) * c_in.to_kind(Kind::Float).view([b, 1, side, 1])
            }
            None => Tensor::full([], f64::from(scale), (Kind::Float, dev)),
        };
        let _ = img.addcmul_(&noise, &scale);
        let x = img.permute([0, 3, 1, 2]);
        Ok((if dev.is_cuda() { x } else { x.contiguous() }, labels))
    }
}

/// The crop at offset (`dy`, `dx`) of the image padded with `pad` zeros on
/// every side, mirrored left to right when `flip`: torchvision's
/// `RandomCrop(size, padding)` then `RandomHorizontalFlip`.
pub fn crop_flip(px: &[f32], channels: usize, size: usize, pad: usize, dy: usize, dx: usize, flip: bool) -> Vec<f32> {
    let mut out = vec![0.0f32; px.len()];
    for c in 0..channels {
        let plane = &px[c * size * size..(c + 1) * size * size];
        let dst = &mut out[c * size * size..(c + 1) * size * size];
        for y in 0..size {
            // Row y of the crop is row y + dy - pad of the image.
            let sy = y + dy;
            if sy < pad || sy >= size + pad {
                continue;
            }
            let row = &plane[(sy - pad) * size..(sy - pad + 1) * size];
            for x in 0..size {
                let sx = x + dx;
                if sx < pad || sx >= size + pad {
                    continue;
                }
                let to = if flip { size - 1 - x } else { x };
                dst[y * size + to] = row[sx - pad];
            }
        }
    }
    out
}

pub use harness_format::suite::floor::label_noise_entropy;

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(classes: usize, size: usize, noise: f64, label_noise: f64) -> ImageSpec {
        ImageSpec { classes, size, channels: 3, noise, label_noise, padding: 2, seed: 5 }
    }

    /// The true posterior of every label given a clean (un-augmented)
    /// image, from the Gaussian likelihoods of all prototypes and the label
    /// noise, computed without the separation assumption.
    fn posterior(src: &ImageSource, px_normalised: &[f32]) -> Vec<f64> {
        let (m, s) = src.norm;
        let sigma = src.spec.noise;
        let k = src.spec.classes;
        let x: Vec<f64> = px_normalised.iter().map(|v| (v * s + m) as f64).collect();
        let logl: Vec<f64> = (0..k)
            .map(|c| {
                let mu = src.prototype(c);
                -x.iter().zip(&mu).map(|(a, b)| (a - *b as f64).powi(2)).sum::<f64>() / (2.0 * sigma * sigma)
            })
            .collect();
        let top = logl.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = logl.iter().map(|l| (l - top).exp()).collect();
        let z: f64 = w.iter().sum();
        let p = src.spec.label_noise;
        (0..k).map(|y| (0..k).map(|c| w[c] / z * if y == c { 1.0 - p } else { p / (k as f64 - 1.0) }).sum()).collect()
    }

    #[test]
    fn the_floor_and_best_accuracy_are_what_the_true_posterior_reaches() {
        // Three settings; a formula without the K - 1 (0.33 instead of 0.55
        // nats at p = 0.1, K = 10) or with p in place of 1 - p fails them.
        for (k, p) in [(10, 0.1), (4, 0.3), (7, 0.0)] {
            let src = ImageSource::new(spec(k, 16, 0.3, p), false).unwrap();
            let n = 20_000u64;
            let (mut nll, mut hits) = (0.0, 0u64);
            for i in 0..n {
                let mut rng = ChaCha8Rng::seed_from_u64(99);
                rng.set_stream(i);
                let s = src.sample(&mut rng);
                let post = posterior(&src, &s.pixels);
                nll -= post[s.label as usize].ln();
                let best = (0..k).max_by(|&a, &b| post[a].total_cmp(&post[b])).unwrap();
                hits += (best == s.label as usize) as u64;
            }
            let (nll, acc) = (nll / n as f64, hits as f64 / n as f64);
            // Standard errors: at most 1.4 nats and 0.46 per sample.
            let floor = src.loss_floor();
            assert!((nll - floor).abs() < 0.035, "K={k} p={p}: posterior cross-entropy {nll}, floor {floor}");
            assert!((acc - src.best_accuracy()).abs() < 0.012, "K={k} p={p}: posterior accuracy {acc}, best {}", src.best_accuracy());
        }
        assert!((label_noise_entropy(0.1, 10) - (-(0.9f64 * 0.9f64.ln()) - 0.1 * (0.1f64 / 9.0).ln())).abs() < 1e-12);
    }

    #[test]
    fn classes_too_close_for_the_floor_are_refused() {
        assert!(matches!(ImageSource::new(spec(10, 8, 5.0, 0.1), false), Err(ImageError::NotSeparable { .. })));
    }

    #[test]
    fn crops_shift_and_flips_mirror() {
        // One channel, 3x3: 1..9.
        let px: Vec<f32> = (1..=9).map(|v| v as f32).collect();
        assert_eq!(crop_flip(&px, 1, 3, 1, 1, 1, false), px, "the centre crop is the image");
        assert_eq!(crop_flip(&px, 1, 3, 1, 1, 1, true), vec![3., 2., 1., 6., 5., 4., 9., 8., 7.]);
        // Offset (0, 0): one row and one column of padding enter top left.
        assert_eq!(crop_flip(&px, 1, 3, 1, 0, 0, false), vec![0., 0., 0., 0., 1., 2., 0., 4., 5.]);
        assert_eq!(crop_flip(&px, 1, 3, 1, 2, 2, false), vec![5., 6., 0., 8., 9., 0., 0., 0., 0.]);
    }

    #[test]
    fn samples_are_normalised_and_fixed_by_their_generator() {
        let src = ImageSource::new(spec(10, 16, 0.5, 0.1), true).unwrap();
        let draw = |i: u64| {
            let mut rng = ChaCha8Rng::seed_from_u64(3);
            rng.set_stream(i);
            src.sample(&mut rng)
        };
        assert_eq!(draw(7).pixels, draw(7).pixels);
        assert_ne!(draw(7).pixels, draw(8).pixels);
        // Clean samples: every pixel is standardised.
        let clean = src.with_augment(false);
        let mut all = Vec::new();
        for i in 0..400 {
            let mut rng = ChaCha8Rng::seed_from_u64(4);
            rng.set_stream(i);
            all.extend(clean.sample(&mut rng).pixels);
        }
        let mean = all.iter().map(|&v| v as f64).sum::<f64>() / all.len() as f64;
        let var = all.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / all.len() as f64;
        assert!(mean.abs() < 0.05 && (var - 1.0).abs() < 0.1, "mean {mean}, variance {var}");
    }

    /// The host's maths for the device pipeline's draws: the prototype,
    /// plus `noise` (pixel space, or none), cropped, flipped, normalised.
    fn host_image(src: &ImageSource, d: &Draw, noise: Option<&[f32]>) -> Vec<f32> {
        let mut px = src.prototype(d.class);
        if let Some(e) = noise {
            for (v, e) in px.iter_mut().zip(e) {
                *v += src.spec.noise as f32 * e;
            }
        }
        let px = crop_flip(&px, src.spec.channels, src.spec.size, src.spec.padding, d.dy, d.dx, d.flip);
        px.iter().map(|v| (v - src.norm.0) / src.norm.1).collect()
    }

    fn draws(src: &ImageSource, seed: u64, range: std::ops::Range<u64>) -> Vec<Draw> {
        range.map(|i| src.draw(&mut crate::data::sample_rng(seed, i))).collect()
    }

    #[test]
    fn device_images_crop_flip_and_normalise_as_the_host_does() {
        // No pixel noise: the device's images are the host's maths exactly
        // (up to f32 rounding of the prototypes), sample for sample; on the
        // GPU machines on CUDA too.
        let src = ImageSource::new(spec(10, 8, 0.0, 0.3), true).unwrap();
        let cuda = tch::Cuda::is_available();
        if !cuda {
            eprintln!("CUDA part skipped: no CUDA device (it runs on the GPU machines)");
        }
        for dev in std::iter::once(tch::Device::Cpu).chain(cuda.then_some(tch::Device::Cuda(0))) {
            device_images_match_the_host(&src, dev);
        }
    }

    fn device_images_match_the_host(src: &ImageSource, dev: tch::Device) {
        let (x, y) = DeviceImages::new(src, 9, 5, dev).next(16).unwrap();
        let (x, y) = (x.to_device(tch::Device::Cpu), y.to_device(tch::Device::Cpu));
        assert_eq!(x.size(), [16, 3, 8, 8]);
        let ds = draws(src, 9, 5..21);
        assert!(ds.iter().any(|d| d.flip) && ds.iter().any(|d| !d.flip) && ds.iter().any(|d| d.dy != 2));
        assert!(ds.iter().any(|d| d.label != d.class), "label noise 0.3 flipped none of 16 labels");
        assert_eq!(Vec::<i64>::try_from(&y).unwrap(), ds.iter().map(|d| d.label as i64).collect::<Vec<_>>());
        for (i, d) in ds.iter().enumerate() {
            let got = Vec::<f32>::try_from(&x.get(i as i64).flatten(0, -1)).unwrap();
            let want = host_image(src, d, None);
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(worst < 1e-5, "{dev:?}, sample {i}: off by {worst}");
        }
    }

    #[test]
    fn device_images_leave_the_padding_of_a_crop_without_noise() {
        // A crop shifted past the image's edge shows padding (pixel value 0)
        // there, exactly, and noisy image pixels everywhere else.
        let src = ImageSource::new(spec(10, 16, 0.5, 0.0), true).unwrap();
        let (x, _) = DeviceImages::new(&src, 7, 0, tch::Device::Cpu).next(32).unwrap();
        let pad = -src.norm.0 / src.norm.1;
        let (mut padding, mut shown) = (0, 0);
        for (i, d) in draws(&src, 7, 0..32).iter().enumerate() {
            let got = Vec::<f32>::try_from(&x.get(i as i64).flatten(0, -1)).unwrap();
            let ones = vec![1.0f32; src.pixels()];
            let mask = crop_flip(&ones, src.spec.channels, src.spec.size, src.spec.padding, d.dy, d.dx, d.flip);
            for (g, m) in got.iter().zip(&mask) {
                if *m == 0.0 {
                    assert_eq!(*g, pad, "sample {i}: a padding pixel carries noise");
                    padding += 1;
                } else {
                    assert_ne!(*g, pad, "sample {i}: an image pixel is padding");
                    shown += 1;
                }
            }
        }
        assert!(padding > 0 && shown > padding, "{padding} padding pixels, {shown} shown");
    }

    #[test]
    fn device_images_carry_unit_pixel_noise_fixed_by_seed_and_position() {
        let src = ImageSource::new(spec(10, 16, 0.5, 0.1), false).unwrap();
        let batch = |seed: u64, start: u64| DeviceImages::new(&src, seed, start, tch::Device::Cpu).next(32).unwrap().0;
        let a = batch(3, 0);
        assert!(a.equal(&batch(3, 0)), "the same seed and position gave other images");
        assert!(!a.equal(&batch(4, 0)) && !a.equal(&batch(3, 32)));
        // A stream moved to a batch's start (a restore) makes that batch.
        let mut s = DeviceImages::new(&src, 3, 0, tch::Device::Cpu);
        let _ = s.next(32).unwrap();
        assert!(s.next(32).unwrap().0.equal(&batch(3, 32)));
        // What is left after taking the clean images away is the pixel
        // noise: standard normal in units of `noise`.
        let mut e = Vec::new();
        for (i, d) in draws(&src, 3, 0..32).iter().enumerate() {
            let got = Vec::<f32>::try_from(&a.get(i as i64).flatten(0, -1)).unwrap();
            let clean = host_image(&src, d, None);
            e.extend(got.iter().zip(&clean).map(|(g, c)| ((g - c) * src.norm.1 / 0.5) as f64));
        }
        let mean = e.iter().sum::<f64>() / e.len() as f64;
        let var = e.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / e.len() as f64;
        assert!(mean.abs() < 0.02 && (var - 1.0).abs() < 0.03, "noise mean {mean}, variance {var} over {} pixels", e.len());
    }
}
