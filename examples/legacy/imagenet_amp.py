"""An ImageNet-style classifier trained with Apex's amp, written for GPUs in the Apex era.

After NVIDIA Apex's examples/imagenet/main_amp.py: a data prefetcher that
copies the next batch to the GPU on a side torch.cuda.Stream with
.cuda(non_blocking=True) and hands it over with record_stream(),
torch.cuda.synchronize() before timing, and, with --distributed,
torch.distributed with NCCL and apex.parallel.DistributedDataParallel. The
data are synthetic 32x32 uint8 images of ten classes and the network a small
ResNet, so that it runs in seconds.

    python imagenet_amp.py --opt-level O2                                  # on a GPU, with apex
    amp-patch run --device cpu imagenet_amp.py --opt-level O2              # unchanged, on a CPU
    torchrun --nproc_per_node 2 -m amp_patch run --device cpu imagenet_amp.py --distributed

It prints the loss every --print-freq iterations, then the mean loss over the
first and the last iterations.
"""
import argparse
import os
import time

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
import torch.utils.data.distributed

try:
    from apex import amp
    from apex.parallel import DistributedDataParallel as DDP
except ImportError:
    raise ImportError("Please install apex from https://www.github.com/nvidia/apex "
                      "to run this example.")


def parse():
    parser = argparse.ArgumentParser(description='ImageNet-style training with amp')
    parser.add_argument('--epochs', default=2, type=int, metavar='N', help='epochs to run')
    parser.add_argument('-b', '--batch-size', default=32, type=int, metavar='N',
                        help='mini-batch size per process (default: 32)')
    parser.add_argument('--images', default=320, type=int, help='synthetic training images')
    parser.add_argument('--lr', '--learning-rate', default=0.05, type=float, metavar='LR')
    parser.add_argument('--momentum', default=0.9, type=float, metavar='M', help='momentum')
    parser.add_argument('--weight-decay', '--wd', default=1e-4, type=float, metavar='W')
    parser.add_argument('--print-freq', '-p', default=5, type=int, metavar='N')
    parser.add_argument('--deterministic', action='store_true')
    parser.add_argument('--distributed', action='store_true',
                        help='torch.distributed (NCCL) and apex.parallel.DistributedDataParallel; '
                             'set when WORLD_SIZE > 1')
    parser.add_argument('--local_rank', default=os.getenv('LOCAL_RANK', 0), type=int)
    parser.add_argument('--opt-level', type=str, default='O1')
    parser.add_argument('--keep-batchnorm-fp32', type=str, default=None)
    parser.add_argument('--loss-scale', type=str, default=None)
    parser.add_argument('--channels-last', type=bool, default=False)
    return parser.parse_args()


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity, inplace=True)


class TinyResNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(16, 16)
        self.layer2 = BasicBlock(16, 32, stride=2)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def synthetic_imagenet(n, num_classes=10, size=32, seed=0):
    # uint8 images, as a JPEG decoder hands them over: a fixed template per class plus noise.
    g = torch.Generator().manual_seed(seed)
    templates = torch.rand(num_classes, 3, size, size, generator=g) * 255
    targets = torch.randint(num_classes, (n,), generator=g)
    noise = torch.randn(n, 3, size, size, generator=g) * 40
    images = (templates[targets] + noise).clamp(0, 255).to(torch.uint8)
    return torch.utils.data.TensorDataset(images, targets)


def fast_collate(batch, memory_format):
    imgs = [img for img, _ in batch]
    targets = torch.tensor([int(target) for _, target in batch], dtype=torch.int64)
    tensor = torch.zeros((len(imgs),) + tuple(imgs[0].shape), dtype=torch.uint8).contiguous(
        memory_format=memory_format)
    for i, img in enumerate(imgs):
        tensor[i] += img
    return tensor, targets


class data_prefetcher:
    def __init__(self, loader):
        self.loader = iter(loader)
        self.stream = torch.cuda.Stream()
        self.mean = torch.tensor([0.485 * 255, 0.456 * 255, 0.406 * 255]).cuda().view(1, 3, 1, 1)
        self.std = torch.tensor([0.229 * 255, 0.224 * 255, 0.225 * 255]).cuda().view(1, 3, 1, 1)
        self.preload()

    def preload(self):
        try:
            self.next_input, self.next_target = next(self.loader)
        except StopIteration:
            self.next_input = None
            self.next_target = None
            return
        with torch.cuda.stream(self.stream):
            self.next_input = self.next_input.cuda(non_blocking=True)
            self.next_target = self.next_target.cuda(non_blocking=True)
            # With Amp, it isn't necessary to manually convert data to half.
            self.next_input = self.next_input.float()
            self.next_input = self.next_input.sub_(self.mean).div_(self.std)

    def next(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        input = self.next_input
        target = self.next_target
        if input is not None:
            input.record_stream(torch.cuda.current_stream())
        if target is not None:
            target.record_stream(torch.cuda.current_stream())
        self.preload()
        return input, target


class AverageMeter:
    """Computes and stores the average and current value"""
    def __init__(self):
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def to_python_float(t):
    if hasattr(t, 'item'):
        return t.item()
    return t[0]


def reduce_tensor(tensor):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= args.world_size
    return rt


def accuracy(output, target):
    return (output.float().argmax(1) == target).float().mean() * 100


def train(train_loader, model, criterion, optimizer, epoch, history):
    batch_time = AverageMeter()
    losses = AverageMeter()
    top1 = AverageMeter()

    model.train()
    end = time.time()

    prefetcher = data_prefetcher(train_loader)
    input, target = prefetcher.next()
    i = 0
    while input is not None:
        i += 1
        output = model(input)
        loss = criterion(output, target)

        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

        # Average loss across processes, every iteration here: the loss curve is what this shows.
        reduced_loss = reduce_tensor(loss.data.float()) if args.distributed else loss.data
        history.append(to_python_float(reduced_loss))

        if i % args.print_freq == 0:
            prec1 = accuracy(output.data, target)
            if args.distributed:
                prec1 = reduce_tensor(prec1)
            losses.update(history[-1], input.size(0))
            top1.update(to_python_float(prec1), input.size(0))

            torch.cuda.synchronize()
            batch_time.update((time.time() - end) / args.print_freq)
            end = time.time()

            if args.local_rank == 0:
                print(f'Epoch: [{epoch}][{i}/{len(train_loader)}]\t'
                      f'Time {batch_time.val:.3f} ({batch_time.avg:.3f})\t'
                      f'Speed {args.world_size * args.batch_size / batch_time.val:.3f} ({args.world_size * args.batch_size / batch_time.avg:.3f})\t'
                      f'Loss {losses.val:.10f} ({losses.avg:.4f})\t'
                      f'Prec@1 {top1.val:.3f} ({top1.avg:.3f})')
        input, target = prefetcher.next()


def main():
    global args
    args = parse()
    print(f"opt_level = {args.opt_level}")
    print(f"keep_batchnorm_fp32 = {args.keep_batchnorm_fp32}",
          type(args.keep_batchnorm_fp32))
    print(f"loss_scale = {args.loss_scale}", type(args.loss_scale))
    print(f"\nCUDNN VERSION: {torch.backends.cudnn.version()}\n")

    cudnn.benchmark = True
    torch.manual_seed(args.local_rank)
    if args.deterministic:
        cudnn.benchmark = False
        cudnn.deterministic = True
        torch.set_printoptions(precision=10)

    if 'WORLD_SIZE' in os.environ:
        args.distributed = args.distributed or int(os.environ['WORLD_SIZE']) > 1

    args.gpu = 0
    args.world_size = 1

    if args.distributed:
        args.gpu = args.local_rank
        torch.cuda.set_device(args.gpu)
        torch.distributed.init_process_group(backend='nccl', init_method='env://')
        args.world_size = torch.distributed.get_world_size()

    assert torch.backends.cudnn.enabled, "Amp requires cudnn backend to be enabled."

    if args.channels_last:
        memory_format = torch.channels_last
    else:
        memory_format = torch.contiguous_format

    torch.manual_seed(0)  # the same initial weights on every process
    model = TinyResNet()
    model = model.cuda().to(memory_format=memory_format)

    # Scale learning rate based on global batch size
    args.lr = args.lr * float(args.batch_size * args.world_size) / 32.
    optimizer = torch.optim.SGD(model.parameters(), args.lr,
                                momentum=args.momentum,
                                weight_decay=args.weight_decay)

    # Initialize Amp.  Amp accepts either values or strings for the optional override arguments,
    # for convenient interoperation with argparse.
    model, optimizer = amp.initialize(model, optimizer,
                                      opt_level=args.opt_level,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32,
                                      loss_scale=args.loss_scale
                                      )

    # For distributed training, wrap the model with apex.parallel.DistributedDataParallel.
    # This must be done AFTER the call to amp.initialize.
    if args.distributed:
        model = DDP(model, delay_allreduce=True)

    criterion = nn.CrossEntropyLoss().cuda()

    train_dataset = synthetic_imagenet(args.images)
    train_sampler = None
    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)

    collate_fn = lambda b: fast_collate(b, memory_format)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None),
        num_workers=0, pin_memory=True, sampler=train_sampler, collate_fn=collate_fn)

    history = []
    for epoch in range(args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, history)

    if args.local_rank == 0:
        k = max(1, len(history) // 4)
        print('Loss mean over the first %d iterations %.4f, over the last %d %.4f'
              % (k, sum(history[:k]) / k, k, sum(history[-k:]) / k))
    if args.distributed:
        # Drop DDP (its reducer holds the group) and meet before the group goes.
        del model
        dist.barrier()
        dist.destroy_process_group()


if __name__ == '__main__':
    main()
